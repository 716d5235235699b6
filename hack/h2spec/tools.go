//go:build tools

// Package h2spec only pins the command hack/h2spec/build builds, so that `go mod tidy`
// keeps its module in go.mod and go.sum.
package h2spec

import _ "github.com/summerwind/h2spec/cmd/h2spec"
