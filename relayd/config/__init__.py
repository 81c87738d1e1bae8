"""What every section of the configuration shares (the strict base section, secret files
read and followed, the DSN's rules) and the daemon's own sections; the whole configuration
is `relayd.settings`, each sink kind's `[sink]` is in its package under `relayd/sinks/`."""
