"""The local cluster: ``tessera up`` (embedded nats-server and redis-server, every service as a
child process), and the access control it locks them with (NATS users, Redis ACL users)."""
