// Added by kata-sandbox-manager's hack/kata/build to its build copy of Kata's runtime
// module; not part of Kata. Thin exported doors into the shim's sandbox cold-plug, so
// that a program outside this package (hack/kata/oracle) runs Kata's own code.

package containerdshim

import (
	"context"

	"github.com/kata-containers/kata-containers/src/runtime/pkg/oci"
	"github.com/opencontainers/runtime-spec/specs-go"
)

// ColdPlugDevices runs coldPlugDevices, the shim's first step when it creates a pod
// sandbox (create.go), for a shim whose runtime config is runtimeConfig.
func ColdPlugDevices(ctx context.Context, runtimeConfig *oci.RuntimeConfig, ociSpec *specs.Spec) error {
	s := &service{config: runtimeConfig}
	return coldPlugDevices(ctx, s, ociSpec)
}

// GetDeviceSpec runs getDeviceSpec: the CDI names the shim forms from the kubelet's
// PodResources answer for the pod the annotations name.
func GetDeviceSpec(ctx context.Context, socket string, ann map[string]string) ([]string, error) {
	return getDeviceSpec(ctx, socket, ann)
}
