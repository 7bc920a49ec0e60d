"""Run sources: every engine a session can take as reference or subject.

The built-in backends (cpu, sim, cuda) and the foreign engines (hf, process)
share one interface (base.Engine); `make_engine` builds one by name.
"""
