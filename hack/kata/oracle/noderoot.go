// A simulated node shown to Kata's code as the node (--root): the oracle runs again in a
// private mount namespace of its own, where the node's sys and VFIO device nodes are mounted
// where Kata reads them (/sys, /dev). Nothing outside that namespace is touched.

package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

// nsEnv marks the run already inside its private mount namespace.
const nsEnv = "KATA_ORACLE_IN_NAMESPACE"

// reexecInNamespace runs this command again in a private mount namespace.
func reexecInNamespace() int {
	if os.Geteuid() != 0 {
		return usage("--root other than / needs root (a private mount namespace)")
	}
	self, err := os.Executable()
	if err != nil {
		return usage("%v", err)
	}
	cmd := exec.Command(self, os.Args[1:]...)
	cmd.Env = append(os.Environ(), nsEnv+"=1")
	cmd.Stdin, cmd.Stdout = os.Stdin, os.Stdout
	var stderr bytes.Buffer
	cmd.Stderr = io.MultiWriter(os.Stderr, &stderr)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS}
	err = cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode()
	}
	if err != nil {
		return usage("cannot start in a private mount namespace: %v", err)
	}
	return 0
}

// enterRoot makes root's /sys and /dev the ones Kata's code reads, in this (private) mount
// namespace: root/sys on /sys, and on /dev a tmpfs holding root/dev's VFIO nodes as
// character devices (with their numbers where they are devices; where a simulated node has
// plain files, numbers that no sysfs entry of the node names, so Kata's GetHostPath keeps
// the CDI path, as it does on a node whose /sys/dev/char names that path).
func enterRoot(root string) error {
	root, err := filepath.Abs(root)
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(root, "sys", "bus", "pci", "devices")); err != nil {
		return fmt.Errorf("no sys/bus/pci/devices under it: %w", err)
	}
	if err := syscall.Mount("", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making / private: %w", err)
	}
	if err := syscall.Mount(filepath.Join(root, "sys"), "/sys", "", syscall.MS_BIND|syscall.MS_REC, ""); err != nil {
		return fmt.Errorf("mounting its sys on /sys: %w", err)
	}
	if err := syscall.Mount("kata-oracle-dev", "/dev", "tmpfs", syscall.MS_NOSUID, "mode=0755"); err != nil {
		return fmt.Errorf("mounting a tmpfs on /dev: %w", err)
	}
	for name, dev := range map[string][2]uint32{"null": {1, 3}, "zero": {1, 5}, "urandom": {1, 9}, "random": {1, 8}} {
		if err := mknod("/dev/"+name, dev[0], dev[1]); err != nil {
			return err
		}
	}
	// Numbers for plain files: the local/experimental major 240 (Documentation/admin-guide/devices.txt).
	next := uint32(0)
	return filepath.Walk(filepath.Join(root, "dev"), func(path string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(filepath.Join(root, "dev"), path)
		if rel == "." {
			return nil
		}
		target := filepath.Join("/dev", rel)
		if info.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		if rel != "iommu" && !strings.HasPrefix(rel, "vfio/") {
			return nil
		}
		if st, ok := info.Sys().(*syscall.Stat_t); ok && info.Mode()&os.ModeCharDevice != 0 {
			return mknod(target, uint32(st.Rdev>>8)&0xfff, uint32(st.Rdev&0xff)|uint32(st.Rdev>>12)&0xfff00)
		}
		if rel == "vfio/vfio" {
			return mknod(target, 10, 196) // VFIO_MINOR, include/linux/miscdevice.h
		}
		// An iommufd cdev: the numbers its device's sysfs publishes, as udev reads them.
		if name, ok := strings.CutPrefix(rel, "vfio/devices/"); ok {
			if major, minor, ok := cdevNumbers(root, name); ok {
				return mknod(target, major, minor)
			}
		}
		next++
		return mknod(target, 240, next)
	})
}

func cdevNumbers(root, name string) (uint32, uint32, bool) {
	found, _ := filepath.Glob(filepath.Join(root, "sys", "bus", "pci", "devices", "*", "vfio-dev", name, "dev"))
	if len(found) != 1 {
		return 0, 0, false
	}
	data, err := os.ReadFile(found[0])
	if err != nil {
		return 0, 0, false
	}
	var major, minor uint32
	if _, err := fmt.Sscanf(strings.TrimSpace(string(data)), "%d:%d", &major, &minor); err != nil {
		return 0, 0, false
	}
	return major, minor, true
}

func mknod(path string, major, minor uint32) error {
	dev := int((major << 8) | (minor & 0xff) | ((minor &^ 0xff) << 12))
	if err := syscall.Mknod(path, syscall.S_IFCHR|0o666, dev); err != nil {
		return fmt.Errorf("mknod %s %d:%d: %w", path, major, minor, err)
	}
	return nil
}
