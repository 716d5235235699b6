// Added by kata-sandbox-manager's hack/kata/build to its build copy of Kata's runtime
// module; not part of Kata. A thin exported door into what newSandbox (sandbox.go) and
// qemu's CreateVM (qemu.go) do with a pod sandbox's VFIO devices, without starting a VM:
// the calls are Kata's own, in Kata's order; only the VM and its agent are left out.

package virtcontainers

import (
	"context"

	"github.com/kata-containers/kata-containers/src/runtime/pkg/device/api"
	"github.com/kata-containers/kata-containers/src/runtime/pkg/device/config"
	deviceManager "github.com/kata-containers/kata-containers/src/runtime/pkg/device/manager"
	govmmQemu "github.com/kata-containers/kata-containers/src/runtime/pkg/govmm/qemu"
)

// ColdPlugOutcome is what the sandbox's VFIO cold-plug did.
type ColdPlugOutcome struct {
	// coldOrHotPlugVFIO: whether devices are cold-plugged, and the devices it took.
	ColdPlug    bool
	VFIODevices []config.DeviceInfo
	// One entry per device AddDevice attached, in order: the host path it resolved and
	// the VFIO functions the VFIO driver found for it.
	Attached []AttachedVFIO
	// QEMU's configuration after CreateVM's PCIe topology and every AppendDevice.
	Qemu govmmQemu.Config
}

// AttachedVFIO is one device of a sandbox after Sandbox.AddDevice.
type AttachedVFIO struct {
	HostPath  string
	Functions []config.VFIODev
}

// ColdPlugQemu runs, for a QEMU sandbox configured as sandboxConfig, what newSandbox does
// with its VFIO devices: coldOrHotPlugVFIO, the PCIe topology CreateVM builds on q35
// (createPCIeTopology), then Sandbox.AddDevice for each device (the device manager, the
// VFIO driver's Attach, Sandbox.AppendDevice, qemu.AddDevice). The outcome is returned
// with the first error Kata returned, as far as it got.
func ColdPlugQemu(ctx context.Context, sandboxConfig *SandboxConfig) (*ColdPlugOutcome, error) {
	out := &ColdPlugOutcome{}
	hc := &sandboxConfig.HypervisorConfig
	arch, err := newQemuArch(*hc)
	if err != nil {
		return out, err
	}
	q := &qemu{id: sandboxConfig.ID, arch: arch, config: *hc, ctx: ctx}
	// As qemu.setup records them for a new VM.
	q.state.HotPlugVFIO = hc.HotPlugVFIO
	q.state.ColdPlugVFIO = hc.ColdPlugVFIO
	q.state.PCIeRootPort = hc.PCIeRootPort
	q.state.PCIeSwitchPort = hc.PCIeSwitchPort
	s := &Sandbox{id: sandboxConfig.ID, ctx: ctx, hypervisor: q, config: sandboxConfig}
	s.devManager = deviceManager.NewDeviceManager(hc.BlockDeviceDriver, hc.EnableVhostUserStore,
		hc.VhostUserStorePath, hc.VhostUserDeviceReconnect, nil)

	out.ColdPlug, err = s.coldOrHotPlugVFIO(sandboxConfig)
	out.VFIODevices = hc.VFIODevices
	if err != nil {
		return out, err
	}
	machine := q.arch.machine()
	if machine.Type == QemuQ35 || machine.Type == QemuVirt {
		var qemuConfig govmmQemu.Config
		qemuConfig.Machine = machine
		if err := q.createPCIeTopology(&qemuConfig, hc, machine.Type, nil); err != nil {
			return out, err
		}
		q.qemuConfig = qemuConfig
	}
	out.Qemu = q.qemuConfig
	if !out.ColdPlug {
		return out, nil
	}
	for _, dev := range hc.VFIODevices {
		added, err := s.AddDevice(ctx, dev)
		out.Qemu = q.qemuConfig
		if err != nil {
			return out, err
		}
		out.Attached = append(out.Attached, attachedVFIO(added))
	}
	return out, nil
}

func attachedVFIO(dev api.Device) AttachedVFIO {
	out := AttachedVFIO{HostPath: dev.GetHostPath()}
	if vfios, ok := dev.GetDeviceInfo().([]*config.VFIODev); ok {
		for _, v := range vfios {
			if v != nil {
				out.Functions = append(out.Functions, *v)
			}
		}
	}
	return out
}
