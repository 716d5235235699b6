// Added by kata-sandbox-manager's hack/kata/build to its build copy of Kata 3.29's runtime
// module; not part of Kata. The check its loader runs on kernel_verity_params.

package katautils

import (
	vc "github.com/kata-containers/kata-containers/src/runtime/virtcontainers"
)

func init() {
	guestCheck = func(h hypervisor) error {
		_, err := vc.ParseKernelVerityParams(h.kernelVerityParams())
		return err
	}
}
