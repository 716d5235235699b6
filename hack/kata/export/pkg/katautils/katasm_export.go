// Added by kata-sandbox-manager's hack/kata/build to its build copy of Kata's runtime
// module; not part of Kata.

package katautils

import (
	"os"
	"sort"

	"github.com/BurntSushi/toml"
	"github.com/kata-containers/kata-containers/src/runtime/pkg/device/config"
)

// ColdPlugSettings are the settings of a Kata configuration file that the cold-plug reads,
// as decodeConfig and the hypervisor table's accessors read them.
type ColdPlugSettings struct {
	Path               string
	Hypervisors        []string
	ColdPlugVFIO       config.PCIePort
	HotPlugVFIO        config.PCIePort
	PCIeRootPort       uint32
	MachineType        string
	PodResourceAPISock string
	// Keys this Kata's configuration does not know (it ignores them).
	Undecoded []string
}

// DecodeColdPlugSettings reads the [hypervisor.qemu] and [runtime] settings of the file.
func DecodeColdPlugSettings(path string) (ColdPlugSettings, error) {
	tomlConf, resolved, err := decodeConfig(path)
	if err != nil {
		return ColdPlugSettings{}, err
	}
	out := ColdPlugSettings{Path: resolved, PodResourceAPISock: tomlConf.Runtime.PodResourceAPISock}
	for name := range tomlConf.Hypervisor {
		out.Hypervisors = append(out.Hypervisors, name)
	}
	sort.Strings(out.Hypervisors)
	if h, ok := tomlConf.Hypervisor["qemu"]; ok {
		out.ColdPlugVFIO = h.coldPlugVFIO()
		out.HotPlugVFIO = h.hotPlugVFIO()
		out.PCIeRootPort = h.PCIeRootPort
		out.MachineType = h.machineType()
	}
	data, err := os.ReadFile(resolved)
	if err != nil {
		return out, err
	}
	var again tomlConfig
	md, err := toml.Decode(string(data), &again)
	if err != nil {
		return out, err
	}
	for _, key := range md.Undecoded() {
		out.Undecoded = append(out.Undecoded, key.String())
	}
	return out, nil
}
