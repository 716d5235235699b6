// What the oracle prints: the Result of one run as JSON on stdout, Kata's own log lines
// (info and up) in it rather than on the terminal.

package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/sirupsen/logrus"
)

// Result is what the oracle prints.
type Result struct {
	Kata       string `json:"kata"`
	KataCommit string `json:"kata_commit"`
	Pod        struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"pod"`
	Config      Settings     `json:"config"`
	CDIDevices  []string     `json:"cdi_devices"`
	DeviceNodes []DeviceNode `json:"device_nodes"`
	VFIO        []VFIOGroup  `json:"vfio"`
	Plugged     []string     `json:"plugged"`
	RootPorts   int          `json:"root_ports"`
	QemuArgs    []string     `json:"qemu_args"`
	Stage       string       `json:"stage"`
	Error       *string      `json:"error"`
	Log         []string     `json:"log"`
}

// Settings are the Kata configuration values the cold-plug reads.
type Settings struct {
	File               string   `json:"file,omitempty"`
	ColdPlugVFIO       string   `json:"cold_plug_vfio"`
	HotPlugVFIO        string   `json:"hot_plug_vfio"`
	PCIeRootPort       uint32   `json:"pcie_root_port"`
	MachineType        string   `json:"machine_type"`
	PodResourceAPISock string   `json:"pod_resource_api_sock"`
	DeviceSources      []string `json:"pod_resource_device_sources"`
	// Whether this release reads pod_resource_device_sources at all.
	DeviceSourcesRead bool     `json:"pod_resource_device_sources_read"`
	Ignored           []string `json:"ignored_keys"`
	// The guest keys as this release's decoder read them (absent: a key it does not have),
	// and what its own checks of them said.
	Guest        map[string]any `json:"guest"`
	GuestInvalid string         `json:"guest_invalid"`
}

// DeviceNode is one device node of the sandbox's OCI spec after CDI injection (the spec
// keeps no host path: the sandbox finds it again from the numbers, config.GetHostPath).
type DeviceNode struct {
	Path  string `json:"path"`
	Type  string `json:"type"`
	Major int64  `json:"major"`
	Minor int64  `json:"minor"`
}

// VFIOGroup is one VFIO device the sandbox attached: its host node and the functions the
// VFIO driver found in it (an IOMMU group's members less the ones it ignores, or an
// iommufd cdev's one function).
type VFIOGroup struct {
	HostPath  string     `json:"host_path"`
	Functions []Function `json:"functions"`
}

// Function is one PCI function as Kata's VFIO driver describes it.
type Function struct {
	BDF    string `json:"bdf"`
	Class  string `json:"class"`
	Vendor string `json:"vendor"`
	Device string `json:"device"`
	PCIe   bool   `json:"pcie"`
	Bus    string `json:"bus"`
}

type logHook struct{ lines *[]string }

func (h logHook) Levels() []logrus.Level { return logrus.AllLevels[:logrus.InfoLevel+1] }
func (h logHook) Fire(e *logrus.Entry) error {
	line := e.Level.String() + ": " + e.Message
	keys := make([]string, 0, len(e.Data))
	for k := range e.Data {
		if k != "source" && k != "name" && k != "pid" && k != "subsystem" && k != "sandbox" {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		line += fmt.Sprintf(" %s=%v", k, e.Data[k])
	}
	*h.lines = append(*h.lines, line)
	return nil
}

func emit(res *Result, code int) int {
	// Lists print as [] rather than null.
	for _, list := range []*[]string{&res.Log, &res.CDIDevices, &res.Plugged, &res.QemuArgs} {
		if *list == nil {
			*list = []string{}
		}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(res); err != nil {
		fmt.Fprintf(os.Stderr, "kata-oracle: %v\n", err)
		return 2
	}
	return code
}
