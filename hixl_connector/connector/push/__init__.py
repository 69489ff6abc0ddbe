"""Push mode, both halves: D grants P its blocks and registers them (receiver, contact,
registration), P writes each layer as its forward computes it and its word last (sender,
request_push), D asks about pushes it waits long for (status). Why D never decodes a block
written for another request, or written after it freed it: ``guarded_write``.
"""
