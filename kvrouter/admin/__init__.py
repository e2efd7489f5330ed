"""The admin API and everything behind it: drain, undrain, live reload of replicas.yaml (POST or SIGHUP), the
/ready and /live probes, and the sharing of drain flags and reloads between router instances through Redis.

* `api.py` — the HTTP shell: routes, admin-token check, probes, SIGHUP; talks to the fleet through `FleetHooks`.
* `fleet.py` — the fleet an operator steers: `plan_reload` (pure), drain flags, `FleetAdmin`, admin metrics.
* `shared.py` — the same state shared through Redis (`RedisAdminState`) so every instance agrees.
* `control.py` — `AppFleetHooks`: the admin API's hands on a running router's replica set, load book and index;
  `setup_fleet_admin` wires the three above into an app.
"""
