"""The operator's side: the admin API ``/v1/cluster/…`` (proxied to the scheduler), its live
events feed (server-sent events) and the dashboard page with its static files."""
