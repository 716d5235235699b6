// Command kata-oracle says what a Kata release's own runtime code does with a pod's
// devices when it creates the pod's sandbox: the shim's cold-plug (the kubelet's
// PodResources answer turned into CDI names, resolved and injected into the sandbox's OCI
// spec), then the sandbox's VFIO assembly (the devices the OCI spec names, the VFIO
// functions of each IOMMU group or iommufd cdev, the PCIe root ports and QEMU's `-device`
// arguments). It starts no VM: everything after QEMU's command line is left out.
//
// hack/kata/build builds it once per pinned Kata release, against that release's code
// (with thin exported wrappers of ours, hack/kata/export). It prints one JSON object and
// exits 0 when Kata would go on to start the VM, 1 when Kata fails the sandbox (the JSON
// carries Kata's error), 2 when the oracle's own arguments are wrong.
//
//	kata-oracle --pod-resources /var/lib/kubelet/pod-resources/kubelet.sock \
//	    --pod default/gpu-pod [--cdi-dir DIR]... [--root DIR] [--kata-config FILE]
//
// With --root other than /, the node's /sys and /dev are those under DIR (a simulated
// node): the oracle runs in a private mount namespace of its own (root only) where DIR/sys
// is mounted on /sys and a fresh /dev holds DIR/dev's VFIO nodes as character devices,
// which is what Kata's code reads on a node. Nothing outside that namespace is touched.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	cdi "github.com/container-orchestrated-devices/container-device-interface/pkg/cdi"
	containerdshim "github.com/kata-containers/kata-containers/src/runtime/pkg/containerd-shim-v2"
	"github.com/kata-containers/kata-containers/src/runtime/pkg/device/config"
	"github.com/kata-containers/kata-containers/src/runtime/pkg/katautils"
	"github.com/kata-containers/kata-containers/src/runtime/pkg/oci"
	vc "github.com/kata-containers/kata-containers/src/runtime/virtcontainers"
	"github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	os.Exit(run())
}

func usage(format string, a ...interface{}) int {
	fmt.Fprintf(os.Stderr, "kata-oracle: "+format+"\n", a...)
	return 2
}

func run() int {
	var (
		podResources  = flag.String("pod-resources", "", "the kubelet's PodResources socket ([runtime] pod_resource_api_sock; overrides --kata-config's)")
		pod           = flag.String("pod", "", "NAMESPACE/NAME: the pod, as containerd's CRI annotates its sandbox")
		root          = flag.String("root", "/", "the node's root: its /sys and /dev (a simulated node's dir)")
		kataConfig    = flag.String("kata-config", "", "a Kata configuration file to take the cold-plug settings from")
		coldPlug      = flag.String("cold-plug-vfio", "", "[hypervisor.qemu] cold_plug_vfio (default: the config's, else root-port)")
		rootPorts     = flag.Uint("pcie-root-port", 0, "[hypervisor.qemu] pcie_root_port (default: the config's)")
		deviceSources = flag.String("device-sources", "", "[runtime] pod_resource_device_sources, comma-separated (default: the config's)")
		timeout       = flag.Duration("timeout", 10*time.Second, "bound on the whole run")
		cdiDirs       listFlag
		annotations   listFlag
	)
	flag.Var(&cdiDirs, "cdi-dir", "a CDI spec dir (repeatable; default /etc/cdi and /var/run/cdi)")
	flag.Var(&annotations, "annotation", "KEY=VALUE on the sandbox's OCI spec (repeatable)")
	flag.Parse()
	if flag.NArg() != 0 {
		return usage("unexpected arguments %v", flag.Args())
	}

	if *root != "/" && os.Getenv(nsEnv) == "" {
		return reexecInNamespace()
	}
	if *root != "/" {
		if err := enterRoot(*root); err != nil {
			return usage("cannot show Kata the node at %s: %v", *root, err)
		}
	}

	ann := map[string]string{
		// What containerd's CRI puts on a sandbox container's spec.
		"io.kubernetes.cri.container-type": "sandbox",
	}
	if *pod != "" {
		ns, name, ok := strings.Cut(*pod, "/")
		if !ok || ns == "" || name == "" {
			return usage("--pod %q is not NAMESPACE/NAME", *pod)
		}
		ann["io.kubernetes.cri.sandbox-namespace"] = ns
		ann["io.kubernetes.cri.sandbox-name"] = name
	}
	for _, a := range annotations {
		k, v, ok := strings.Cut(a, "=")
		if !ok || k == "" {
			return usage("--annotation %q is not KEY=VALUE", a)
		}
		ann[k] = v
	}

	var res Result
	res.Kata = katautils.VERSION
	res.KataCommit = katautils.COMMIT
	res.Pod.Namespace = firstOf(ann, "io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri-o.Namespace")
	res.Pod.Name = firstOf(ann, "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri-o.KubeName")
	res.CDIDevices, res.DeviceNodes, res.VFIO, res.Plugged, res.QemuArgs = []string{}, []DeviceNode{}, []VFIOGroup{}, []string{}, []string{}

	// Kata's log lines (info and up) go into the result, none to the terminal.
	logrus.SetOutput(io.Discard)
	logrus.SetLevel(logrus.InfoLevel)
	logrus.AddHook(logHook{&res.Log})

	settings := Settings{ColdPlugVFIO: string(config.RootPort), MachineType: "q35", DeviceSources: []string{"device-plugin"}}
	if *kataConfig != "" {
		decoded, err := katautils.DecodeColdPlugSettings(*kataConfig)
		if err != nil {
			return usage("--kata-config %s: %v", *kataConfig, err)
		}
		settings.File = decoded.Path
		settings.ColdPlugVFIO = string(decoded.ColdPlugVFIO)
		settings.HotPlugVFIO = string(decoded.HotPlugVFIO)
		settings.PCIeRootPort = decoded.PCIeRootPort
		settings.MachineType = decoded.MachineType
		settings.PodResourceAPISock = decoded.PodResourceAPISock
		settings.Ignored = decoded.Undecoded
		settings.Guest, settings.GuestInvalid = decoded.Guest, decoded.GuestInvalid
		if sources, err := readDeviceSources(decoded.Path); err != nil {
			return usage("--kata-config %s: %v", *kataConfig, err)
		} else if sources != nil {
			settings.DeviceSources = sources
		}
	}
	if *coldPlug != "" {
		settings.ColdPlugVFIO = *coldPlug
	}
	if *rootPorts != 0 {
		settings.PCIeRootPort = uint32(*rootPorts)
	}
	if *podResources != "" {
		settings.PodResourceAPISock = *podResources
	}
	if *deviceSources != "" {
		settings.DeviceSources = strings.Split(*deviceSources, ",")
	}
	// Whether this release has the setting: its configuration knows the key.
	settings.DeviceSourcesRead = !contains(settings.Ignored, "runtime.pod_resource_device_sources") &&
		configKnows("pod_resource_device_sources")
	if settings.Ignored == nil {
		settings.Ignored = []string{}
	}
	res.Config = settings
	port := config.PCIePort(settings.ColdPlugVFIO)
	if !port.Valid() {
		return usage("cold_plug_vfio %q is not one of Kata's ports", settings.ColdPlugVFIO)
	}

	// The CDI registry the shim's injection uses (config.InjectCDIDevices) is a process-wide one; configured here
	// first, Kata's own GetRegistry() calls then find it with these dirs.
	if len(cdiDirs) > 0 {
		cdi.GetRegistry(cdi.WithSpecDirs(cdiDirs...))
	}

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	fail := func(stage string, err error) int {
		res.Stage = stage
		msg := err.Error()
		res.Error = &msg
		return emit(&res, 1)
	}

	runtimeConfig := &oci.RuntimeConfig{
		HypervisorType:     vc.QemuHypervisor,
		PodResourceAPISock: settings.PodResourceAPISock,
	}
	hc := &runtimeConfig.HypervisorConfig
	hc.ColdPlugVFIO = port
	hc.HotPlugVFIO = config.PCIePort(settings.HotPlugVFIO)
	if hc.HotPlugVFIO == "" {
		hc.HotPlugVFIO = config.NoPort
	}
	hc.PCIeRootPort = settings.PCIeRootPort
	hc.HypervisorMachineType = settings.MachineType
	hc.BlockDeviceDriver = config.VirtioSCSI

	spec := sandboxSpec(ann)

	// 1. The shim: PodResources -> CDI names (getDeviceSpec), then coldPlugDevices.
	if settings.PodResourceAPISock != "" && port != config.NoPort {
		names, err := containerdshim.GetDeviceSpec(ctx, settings.PodResourceAPISock, ann)
		if err != nil {
			return fail("pod-resources", fmt.Errorf("device cold plug failed: %w", err))
		}
		if names != nil {
			res.CDIDevices = names
		}
	}
	if err := containerdshim.ColdPlugDevices(ctx, runtimeConfig, spec); err != nil {
		// create.go wraps it so.
		return fail("cdi", fmt.Errorf("device cold plug failed: %w", err))
	}
	for _, d := range spec.Linux.Devices {
		res.DeviceNodes = append(res.DeviceNodes, DeviceNode{Path: d.Path, Type: d.Type, Major: d.Major, Minor: d.Minor})
	}

	// 2. The sandbox: the OCI spec -> SandboxConfig (oci.SandboxConfig), then the VFIO
	// cold-plug of newSandbox and CreateVM.
	sandboxConfig, err := oci.SandboxConfig(*spec, *runtimeConfig, "/run/kata-oracle/bundle", "kata-oracle", false, false)
	if err != nil {
		return fail("sandbox-config", err)
	}
	outcome, err := vc.ColdPlugQemu(ctx, &sandboxConfig)
	if outcome != nil {
		for _, a := range outcome.Attached {
			g := VFIOGroup{HostPath: a.HostPath, Functions: []Function{}}
			for _, f := range a.Functions {
				g.Functions = append(g.Functions, Function{BDF: f.BDF, Class: f.Class, Vendor: f.VendorID,
					Device: f.DeviceID, PCIe: f.IsPCIe, Bus: f.Bus})
			}
			res.VFIO = append(res.VFIO, g)
		}
		res.QemuArgs = outcome.Qemu.DeviceParams()
		for i := 0; i+1 < len(res.QemuArgs); i++ {
			if res.QemuArgs[i] != "-device" {
				continue
			}
			arg := res.QemuArgs[i+1]
			if strings.HasPrefix(arg, "pcie-root-port,") {
				res.RootPorts++
			}
			if bdf, ok := vfioHost(arg); ok {
				res.Plugged = append(res.Plugged, bdf)
			}
		}
	}
	if err != nil {
		return fail("sandbox", err)
	}
	res.Stage = "ready"
	return emit(&res, 0)
}

// sandboxSpec is the pod sandbox's OCI spec as containerd hands it to the shim, as far as
// the cold-plug reads it.
func sandboxSpec(ann map[string]string) *specs.Spec {
	return &specs.Spec{
		Version:     specs.Version,
		Annotations: ann,
		Root:        &specs.Root{Path: "rootfs", Readonly: true},
		Process:     &specs.Process{Args: []string{"/pause"}, Cwd: "/"},
		Linux:       &specs.Linux{Resources: &specs.LinuxResources{}},
	}
}

func vfioHost(arg string) (string, bool) {
	if !strings.HasPrefix(arg, "vfio-pci,") {
		return "", false
	}
	for _, part := range strings.Split(arg, ",") {
		if v, ok := strings.CutPrefix(part, "host="); ok {
			return v, true
		}
	}
	return "", false
}

func firstOf(m map[string]string, keys ...string) string {
	for _, k := range keys {
		if m[k] != "" {
			return m[k]
		}
	}
	return ""
}
