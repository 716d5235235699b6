// Command pause is the first process of a pod's sandbox ("infra") container, as the
// CRI runtime starts it for every pod: it does nothing but hold the pod's namespaces
// open until it is told to stop.
//
//   - SIGINT or SIGTERM: exit 0 (the runtime stopping the sandbox).
//   - SIGCHLD: reap every child that has exited. As PID 1 of the pod's PID namespace
//     (shareProcessNamespace), it inherits the orphans of the pod's other processes, and
//     a child left unreaped stays a zombie holding a PID.
//
// Every other signal is ignored: PID 1 of a namespace gets only the signals it handles.
// `pause -v` prints the version. Built static (CGO_ENABLED=0) by hack/image/build into
// the image registry.k8s.io/pause:<version>, so a node can run pods with no registry.
package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

// version is set at build time: -ldflags "-X main.version=3.10.1".
var version = "dev"

func main() {
	if len(os.Args) > 1 {
		if os.Args[1] == "-v" && len(os.Args) == 2 {
			fmt.Printf("pause %s (kata-sandbox-manager)\n", version)
			return
		}
		fmt.Fprintln(os.Stderr, "usage: pause [-v]")
		os.Exit(2)
	}
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "pause: warning: not the first process of its PID namespace")
	}

	// Buffered: a burst of signals arriving while one is handled is not lost (SIGCHLDs
	// may coalesce, which reapAll covers by reaping until none is left).
	signals := make(chan os.Signal, 32)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	// A child that exited before Notify took effect sent its SIGCHLD to nobody.
	reapAll()
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			reapAll()
			continue
		}
		fmt.Fprintf(os.Stderr, "pause: got %v, exiting\n", sig)
		os.Exit(0)
	}
}

// reapAll collects the exit status of every exited child without blocking: it stops
// when children remain but none has exited (pid 0) or none remains (ECHILD).
func reapAll() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
	}
}
