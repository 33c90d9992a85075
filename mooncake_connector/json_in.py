"""JSON from outside (peers' messages, metadata records, upstream answers):
json.loads whose only failure is ValueError.  A value nested deeper than
Python's stack made json.loads raise RecursionError, which the callers'
`except ValueError` did not catch."""
import json


def loads(raw, **kw):
    """json.loads(raw, **kw); ValueError (not RecursionError) for a value
    nested too deeply to read."""
    try:
        return json.loads(raw, **kw)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
