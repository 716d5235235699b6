// Added by kata-sandbox-manager's hack/kata/build to its build copy of Kata's runtime
// module; not part of Kata.

package qemu

// DeviceParams runs appendDevices, which turns config.Devices into QEMU's command-line
// arguments when govmm launches QEMU (LaunchQemu), and returns those arguments.
func (config *Config) DeviceParams() []string {
	saved := config.qemuParams
	config.qemuParams = nil
	config.appendDevices(nil)
	params := config.qemuParams
	config.qemuParams = saved
	return params
}
