"""What serves only HIXL's own samples on the native engine (the connector never calls it):
rank-table links, layer-wise ``transfer_cache_async``, the calls that stay in this process,
and the row transfers' argument rules."""
