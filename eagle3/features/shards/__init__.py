"""Shard files: one safetensors file of concatenated samples plus a ``.done.json`` written last.

A shard exists for readers only when its ``shard-NNNNN.done.json`` is present, names the current
spec hash and records the safetensors file's exact size. ``ShardStream`` writes a shard into a temp
file as its samples arrive, checking each sample (request echo, shapes, finiteness, ids) before its
rows are written and hashing the bytes in file order (no second pass over a multi-GB file); once
every sample is in it fsyncs, renames into place, then writes the done file. ``write_shard``
validates a whole list, then streams it. A crash or a bad sample leaves the old state or a temp file.

The safetensors file is serialized here rather than by ``safetensors.torch.save_file`` so that
(a) per-sample tensors are written straight from their buffers without first concatenating them
(which would double peak memory), (b) the sha256 is computed on the bytes as they are written,
and (c) the exact file size and every tensor's offset are known from the spec and the request
alone, which makes the disk preflight exact (``shard_file_bytes``) and lets rows be written as
soon as they exist. The files are standard safetensors; any reader loads them.

One module per job, each importing only those above it:

    layout   file names, the spec hash, tensor layout, header bytes, exact file size
    done     ShardDone (the done file), completeness of a shard and of a directory
    check    validation of captured samples against the spec and the request
    writer   ShardStream (rows written in place, hashed on a thread), write_shard
    reader   ShardReader (memory-mapped random access, sha256-verified on first open)
"""
