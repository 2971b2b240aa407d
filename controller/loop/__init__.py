"""The control loop and its roles: control (poll, decide, act, record), poller, actuator, recorder, calls, the
loop's state and the GPU's room. Import from those modules: this package's own import loads nothing."""
