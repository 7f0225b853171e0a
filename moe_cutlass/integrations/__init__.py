"""Adapters that put MoELayer into other libraries' models (`transformers`)."""
