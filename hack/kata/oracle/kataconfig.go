// The Kata configuration as the oracle reads it beside Kata's own decoder: a key written in
// the file whether or not this release knows it, and whether this release knows it.

package main

import (
	"fmt"
	"os"

	"github.com/BurntSushi/toml"
	"github.com/kata-containers/kata-containers/src/runtime/pkg/katautils"
)

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// configKnows says whether this release's Kata configuration has a [runtime] key: the
// oracle asks Kata's decoder about a file holding only that key.
func configKnows(key string) bool {
	f, err := os.CreateTemp("", "kata-oracle-*.toml")
	if err != nil {
		return false
	}
	defer os.Remove(f.Name())
	fmt.Fprintf(f, "[runtime]\n%s = [\"device-plugin\"]\n", key)
	f.Close()
	decoded, err := katautils.DecodeColdPlugSettings(f.Name())
	return err == nil && !contains(decoded.Undecoded, "runtime."+key)
}

// readDeviceSources reads [runtime] pod_resource_device_sources from the file as written
// (nil when absent), whether or not this release knows the key.
func readDeviceSources(path string) ([]string, error) {
	var doc struct {
		Runtime struct {
			Sources []string `toml:"pod_resource_device_sources"`
		} `toml:"runtime"`
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if _, err := toml.Decode(string(data), &doc); err != nil {
		return nil, err
	}
	return doc.Runtime.Sources, nil
}
