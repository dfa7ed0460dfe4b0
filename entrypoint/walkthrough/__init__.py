"""The end-to-end walkthrough: a coding agent's third turn through the whole stack.

``kvstack walkthrough`` (``cli.main``) starts the kvstore daemon, a vision
encoder, prefill and decode workers (the reference engine with the plugin) and
the entrypoint on loopback (``launcher``, the local processes), plays the
conversation of ``conversation``, runs turn 3 in three variants against a cold
run, and writes the report of ``report``.
"""
