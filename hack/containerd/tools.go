//go:build tools

// Package containerd only pins the commands hack/kube/build builds from this
// module, so that `go mod tidy` keeps their modules in go.mod and go.sum.
package containerd

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
