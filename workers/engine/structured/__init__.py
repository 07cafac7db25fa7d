"""Structured output: a request's output constraint compiled (llguidance) into token masks, and how the
engine keeps a constraint's failure to its request."""
