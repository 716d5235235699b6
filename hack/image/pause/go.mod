module github.com/kata-sandbox-manager/kata-sandbox-manager/hack/image/pause

go 1.22
