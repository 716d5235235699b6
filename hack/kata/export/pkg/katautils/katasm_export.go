// Added by kata-sandbox-manager's hack/kata/build to its build copy of Kata's runtime
// module; not part of Kata.

package katautils

import (
	"encoding/json"
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
	// The guest keys of [hypervisor.qemu] as this release's decoder filled its hypervisor
	// table, by Go field name; a key this release does not have is absent.
	Guest map[string]any
	// What this release's own checks of those keys said ("" when they passed, or when the
	// release has none: guestCheck is set by a release's own file, export-<release>/).
	GuestInvalid string
}

// guestFields are the hypervisor table's guest fields, as Kata's Go struct names them.
var guestFields = []string{"Kernel", "Image", "Initrd", "RootfsType", "KernelVerityParams", "GuestExtensionImages"}

// guestCheck runs the checks the release's loader runs on the guest keys (nil: none here).
var guestCheck func(h hypervisor) error

func guestOf(h hypervisor) (map[string]any, string) {
	all := map[string]any{}
	if data, err := json.Marshal(h); err == nil {
		_ = json.Unmarshal(data, &all)
	}
	guest := map[string]any{}
	for _, name := range guestFields {
		if value, ok := all[name]; ok {
			guest[name] = value
		}
	}
	if guestCheck != nil {
		if err := guestCheck(h); err != nil {
			return guest, err.Error()
		}
	}
	return guest, ""
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
		out.Guest, out.GuestInvalid = guestOf(h)
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
