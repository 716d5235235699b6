// h2spec, the HTTP/2 conformance suite that tests/plugin/test_h2spec.py runs against the
// device plugin's socket (hack/h2spec/build builds it into the user's cache dir). Test
// harness only: nothing in the product imports Go. h2spec v2.2.1 predates Go modules, so
// its dependencies are pinned here, at the tagged releases nearest the revisions of its
// own Gopkg.lock (the module proxy serves tags, not bare revisions).
module katasandbox.local/h2spec

go 1.25.0

require github.com/summerwind/h2spec v2.2.1+incompatible

require (
	github.com/fatih/color v1.7.0 // indirect
	github.com/inconshreveable/mousetrap v1.0.0 // indirect
	github.com/mattn/go-colorable v0.1.0 // indirect
	github.com/mattn/go-isatty v0.0.4 // indirect
	github.com/spf13/cobra v0.0.3 // indirect
	github.com/spf13/pflag v1.0.3 // indirect
	golang.org/x/net v0.1.0 // indirect
	golang.org/x/sys v0.1.0 // indirect
	golang.org/x/text v0.4.0 // indirect
)
