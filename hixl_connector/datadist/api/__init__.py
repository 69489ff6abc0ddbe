"""The LLM-DataDist v2 surface both back-ends share: CANN's names, codes, descriptors, options
and argument rules."""
