"""The device plugin's own gRPC over HTTP/2 (unix sockets): HPACK, frames, a one-thread server, a small client."""
