// Added by kata-sandbox-manager's hack/kata/build to its build copy of Kata 4.1's runtime
// module; not part of Kata. The checks its loader runs on kernel_verity_params and on
// guest_extension_images (newQemuHypervisorConfig: toGuestExtensionImages).

package katautils

import (
	vc "github.com/kata-containers/kata-containers/src/runtime/virtcontainers"
)

func init() {
	guestCheck = func(h hypervisor) error {
		if _, err := vc.ParseKernelVerityParams(h.kernelVerityParams()); err != nil {
			return err
		}
		_, err := toGuestExtensionImages(h.GuestExtensionImages)
		return err
	}
}
