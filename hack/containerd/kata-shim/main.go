// A stand-in for Kata's containerd-shim-kata-v2 on the real node of tests/node, installed
// where kata-deploy puts Kata's Go shim (<prefix>/opt/kata/bin/containerd-shim-kata-v2).
//
// No Kata guest can start on the test machines, so the "VM" is a runc container: this
// program runs containerd's own runc shim (its shim manager and task service, from the
// containerd module hack/containerd pins), but it is registered the way kata-deploy
// registers Kata (tools/packaging/kata-deploy/binary/src/runtime/containerd.rs:
// runtime_type "io.containerd.kata-<shim>.v2", runtime_path, options.ConfigPath). For such
// a runtime containerd's CRI sends Kata's options, runtimeoptions.v1.Options {TypeUrl,
// ConfigPath, ConfigBody} (internal/cri/config GenerateRuntimeOptions: every runtime_type
// other than runc's and runhcs's), where runc's shim expects runc's Options: its task
// service type-asserts them on Create and its manager's Info refuses them. So this shim,
// like Kata's, takes Kata's options: it reads the Kata configuration file ConfigPath names
// (Kata's shim loads it and fails the sandbox without it) and hands runc's code runc's
// options instead (the runc state dir from KSM_STANDIN_RUNC_ROOT, which hack/local-cluster
// gives containerd, else runc's default).
//
// `containerd-shim-kata-v2 --version` answers in the Go shim's format
// (src/runtime/cmd/containerd-shim-kata-v2/main.go: `Kata Containers containerd shim
// (Golang): id: "io.containerd.kata.v2", version: X, commit: Y`; runtime-rs's where it is
// installed as runtime-rs's shim), X being the release in the install's VERSION file (kata-deploy's prefix holds the release tarball's VERSION,
// local-build/kata-deploy-merge-builds.sh), so katamgr's detection finds the release as
// on a node.
package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types"
	runcoptions "github.com/containerd/containerd/api/types/runc/options"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task"
	"github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/log"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// The id Kata's shim gives itself (its --version line and its RuntimeInfo name).
const kataShimID = "io.containerd.kata.v2"

// A commit no Kata release has: this is not Kata's build.
const commit = "0000000000000000000000000000000000000000"

func main() {
	if len(os.Args) == 2 && (os.Args[1] == "--version" || os.Args[1] == "-version") {
		line, err := versionLine()
		if err != nil {
			fmt.Fprintf(os.Stderr, "containerd-shim-kata-v2 (a stand-in): %v\n", err)
			os.Exit(1)
		}
		fmt.Println(line)
		return
	}
	registry.Register(&plugin.Registration{
		Type:     plugins.TTRPCPlugin,
		ID:       "task",
		Requires: []plugin.Type{plugins.EventPlugin, plugins.InternalPlugin},
		InitFn: func(ic *plugin.InitContext) (interface{}, error) {
			pp, err := ic.GetByID(plugins.EventPlugin, "publisher")
			if err != nil {
				return nil, err
			}
			ss, err := ic.GetByID(plugins.InternalPlugin, "shutdown")
			if err != nil {
				return nil, err
			}
			runc, err := task.NewTaskService(ic.Context, pp.(shim.Publisher), ss.(shutdown.Service))
			if err != nil {
				return nil, err
			}
			return &kataTasks{TTRPCTaskService: runc}, nil
		},
	})
	shim.Run(context.Background(), kataManager{manager.NewShimManager(kataShimID)})
}

// versionLine: the Go shim's --version line, or runtime-rs's where this binary is installed
// as runtime-rs's shim (kata-deploy: <prefix>/runtime-rs/bin/containerd-shim-kata-v2;
// src/runtime-rs/crates/shim/src/bin/main.rs show_version: "(Rust)", the id unquoted), with
// the release in the VERSION file at the install's prefix.
func versionLine() (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	prefix := filepath.Dir(filepath.Dir(self))
	rust := filepath.Base(prefix) == "runtime-rs"
	if rust {
		prefix = filepath.Dir(prefix)
	}
	data, err := os.ReadFile(filepath.Join(prefix, "VERSION"))
	if err != nil {
		return "", fmt.Errorf("no Kata release to report: %w", err)
	}
	release := strings.TrimPrefix(strings.TrimSpace(string(data)), "v")
	if rust {
		return fmt.Sprintf("Kata Containers containerd shim (Rust): id: %s, version: %s, commit: %s",
			kataShimID, release, commit), nil
	}
	return fmt.Sprintf("Kata Containers containerd shim (Golang): id: %q, version: %s, commit: %s",
		kataShimID, release, commit), nil
}

// kataOptions is Kata's runtime options decoded from a protobuf Any, or nil when the Any
// holds none (or other options).
func kataOptions(any typeurl.Any) *runtimeoptions.Options {
	if any == nil || len(any.GetValue()) == 0 {
		return nil
	}
	v, err := typeurl.UnmarshalAny(any)
	if err != nil {
		return nil
	}
	opts, _ := v.(*runtimeoptions.Options)
	return opts
}

// runcOptions: what runc's code is given in place of Kata's options.
func runcOptions() *runcoptions.Options {
	return &runcoptions.Options{Root: os.Getenv("KSM_STANDIN_RUNC_ROOT")}
}

type kataTasks struct {
	taskAPI.TTRPCTaskService
}

func (k *kataTasks) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTTRPCTaskService(server, k)
	return nil
}

// Create takes Kata's options as Kata's shim does: the configuration ConfigPath names must
// load (Kata fails the sandbox otherwise); runc's code then runs with runc's options.
func (k *kataTasks) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (*taskAPI.CreateTaskResponse, error) {
	if opts := kataOptions(r.Options); opts != nil {
		if opts.ConfigPath != "" {
			if _, err := os.ReadFile(opts.ConfigPath); err != nil {
				return nil, fmt.Errorf("kata stand-in: cannot load the Kata configuration %s: %w", opts.ConfigPath, err)
			}
		}
		log.G(ctx).WithField("id", r.ID).WithField("config_path", opts.ConfigPath).
			Info("kata stand-in: Kata runtime options taken, the sandbox runs as a runc container")
		given, err := typeurl.MarshalAnyToProto(runcOptions())
		if err != nil {
			return nil, err
		}
		r.Options = given
	}
	return k.TTRPCTaskService.Create(ctx, r)
}

// kataManager is runc's shim manager, with Kata's options read where runc's are expected.
type kataManager struct {
	shim.Manager
}

func (m kataManager) Info(ctx context.Context, optionsR io.Reader) (*types.RuntimeInfo, error) {
	data, err := io.ReadAll(optionsR)
	if err != nil {
		return nil, err
	}
	var any anypb.Any
	if len(data) > 0 && proto.Unmarshal(data, &any) == nil && kataOptions(&any) != nil {
		data, err = proto.Marshal(typeurlAny(runcOptions()))
		if err != nil {
			return nil, err
		}
	}
	return m.Manager.Info(ctx, bytes.NewReader(data))
}

func typeurlAny(v interface{}) *anypb.Any {
	a, err := typeurl.MarshalAnyToProto(v)
	if err != nil {
		panic(err)
	}
	return a
}
