"""The measuring tools, beside the library rather than in it: `ps-bench` (bench, with the transport floors in
floors and the sparse rows in sparsebench) and `ps-loadgen` (loadgen).  They use the library as a user
would; nothing in the library imports them."""
