"""Virtual-time trace replay: the real `Router`, policies, `LoadBook` and `PrefixIndex` against the simulator's
engine model, on a virtual clock (no sleeps, no sockets). `trace` reads traces, `prompts` turns trace block ids
into token ids and block keys, `driver` runs the event loop, `report` summarises, `cli` is `kvrouter replay`.
"""
