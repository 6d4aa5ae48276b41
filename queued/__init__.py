"""queued: a durable message queue server speaking Kestrel's protocols and journal format."""

__version__ = "0.1.0"
