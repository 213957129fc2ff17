"""Generated etcd v3 API stubs (vendored protos, see README.md and NOTICE in this directory)."""
