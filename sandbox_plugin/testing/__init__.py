"""Stand-ins for parts that cannot run on a build machine (the kubelet), shared by
the tests and ``katamgr demo``."""
