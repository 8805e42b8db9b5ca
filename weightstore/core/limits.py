"""Every size, count and depth bound that weightstore's readers and writers enforce, in one place.

A reader treats its file as hostile: before it allocates, recurses or loops on what a file
claims, it checks the claim against one of these. Writers refuse what readers would refuse, so
every file written is one that reads. Each bound says what it bounds and why that value; the
table in ``docs/security.md`` is generated from this module (``./tasks docs``), so the two
cannot drift. This module imports nothing: every layer reads it.
"""

from __future__ import annotations

# -- keys, tensors, manifests -----------------------------------------------------------------------
#: bytes of UTF-8 in a key: the zip name field is 16-bit, and an npz member is ``key + ".npy"``
MAX_KEY_BYTES = 0xFFFF - len(".npy")
#: dimensions of a tensor: numpy's own limit (``NPY_MAXDIMS``) since numpy 2
MAX_NDIM = 64
#: distinct dtype names in a manifest: more than numpy and ml_dtypes together define
MAX_DTYPES = 1024
#: bytes of one tensor: numpy refuses an array whose size (zero dimensions counted as one) overflows int64
MAX_ARRAY_BYTES = (1 << 63) - 1
#: bytes of a manifest's JSON: some 130 bytes a tensor (40-byte keys, digests), so half a million tensors
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
#: bytes of manifest text per JSON object or array, at least: each costs Python 56-64 bytes, so what a manifest parses
#: into stays a few times its size
MANIFEST_BYTES_PER_CONTAINER = 4

# -- JSON -------------------------------------------------------------------------------------------
#: levels objects and arrays nest in JSON from a file (metadata, ``TF_CONFIG``): Python's ``repr`` and ``json.dumps``
#: recurse once a level and fail near 1,000; writers refuse deeper metadata too
MAX_JSON_DEPTH = 100

# -- npz (zip) --------------------------------------------------------------------------------------
#: bytes of an npy header: numpy's own ``max_header_size`` default
MAX_NPY_HEADER = 10_000
#: times a deflated manifest member may inflate (UTF-32 JSON text deflates 10-30x)
MANIFEST_INFLATION = 32
#: times a deflated member may claim its compressed size: deflate cannot expand further (258-byte matches in 2 bits); a
#: member claiming more is a zip bomb
MAX_DEFLATE_RATIO = 1032
#: bytes a deflated member may claim beyond :data:`MAX_DEFLATE_RATIO` times its compressed size: the ratio is deflate's
#: limit over long streams
DEFLATE_SLACK_BYTES = 1024
#: bytes a zip member's sizes may claim: the checks on whole columns add sizes in int64
MAX_ZIP_MEMBER_BYTES = 1 << 62

# -- safetensors ------------------------------------------------------------------------------------
#: bytes of a safetensors header: the reference library refuses larger ones (``MAX_HEADER_SIZE``), so they are neither
#: written nor read
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
#: bytes of header per JSON object or array, at least: a tensor's entry takes 50 or more; ``[[],[],…]`` made 27x its
#: size in lists
SAFETENSORS_BYTES_PER_CONTAINER = 8

# -- HDF5 -------------------------------------------------------------------------------------------
#: levels groups nest in an HDF5 file read: a 10,000-deep file overflowed the stack
MAX_HDF5_DEPTH = 256
#: times a filtered dataset may claim its stored bytes: no filter h5py ships (deflate, lzf, shuffle) shrinks data more
MAX_HDF5_FILTER_RATIO = 1100
#: bytes a filtered dataset may claim beyond :data:`MAX_HDF5_FILTER_RATIO` times its stored bytes: the ratio is for
#: large datasets
HDF5_FILTER_SLACK_BYTES = 1 << 20
#: continuation blocks of one object header followed before giving up: a loop of them would never end
MAX_HDF5_HEADER_BLOCKS = 64
#: bytes of object headers one check reads (an object's, or the root's for the manifest attribute): headers hold
#: messages, never data
MAX_HDF5_HEADER_BYTES = 16 << 20
#: bytes a global heap collection may have beyond :data:`MAX_MANIFEST_BYTES`: the heap's other objects beside the
#: manifest
HDF5_HEAP_SLACK_BYTES = 1 << 20

# -- Keras files ------------------------------------------------------------------------------------
#: bytes of a ``.keras`` archive's ``config.json``: a few hundred KB even for large architectures
MAX_KERAS_CONFIG_BYTES = 16 << 20
#: bytes of config per JSON object or array, at least: Keras's configs hold one per 50-odd bytes (ResNet50, MobileNetV2:
#: 53, 55)
KERAS_CONFIG_BYTES_PER_CONTAINER = 8
#: members of a ``.keras`` archive: it holds a config, metadata, weights and a few assets, and ``zipfile`` spends 9x the
#: directory on it
MAX_KERAS_MEMBERS = 4096
#: bytes of a Keras sharded ``.weights.json`` map: it names each layer's variable group once, a few hundred bytes per
#: layer
MAX_KERAS_MAP_BYTES = 64 << 20
#: shard files one Keras sharded map may name: far more than any model is split into
MAX_KERAS_SHARDS = 100_000
#: bytes of map per JSON object or array, at least, so what it parses into stays a few times its size
KERAS_MAP_BYTES_PER_CONTAINER = 16

# -- Hugging Face sharded folders -------------------------------------------------------------------
#: bytes of a ``*.safetensors.index.json``: a million tensors' index is some 80 MB
MAX_HF_INDEX_BYTES = 256 << 20
#: bytes of index per JSON object or array, at least: an index is one flat name -> shard map; only its metadata nests
HF_INDEX_BYTES_PER_CONTAINER = 32

# -- TF checkpoints ---------------------------------------------------------------------------------
#: bytes of a checkpoint's ``.index``: about 100 bytes a tensor, so a million tensors stay far below
MAX_TF_INDEX_BYTES = 256 << 20
#: bytes of a ``checkpoint`` state file: it names a few dozen paths
MAX_TF_STATE_FILE_BYTES = 1 << 20
#: slices of one partitioned variable: TF partitions into at most a few hundred in practice
MAX_TF_SLICES = 4096
#: cells per slice of the grid the slices' boundaries cut: a partition has one; more is refused before the tiling is
#: proved
MAX_TF_GRID_CELLS_PER_SLICE = 4
#: data files of one checkpoint: TF numbers them with five digits
MAX_TF_SHARDS = 99_999
#: segments plus characters of object-graph paths per byte of graph: each edge takes at least 4 bytes; 12,000 one-letter
#: edges made 0.7 GB of paths
TF_PATH_UNITS_PER_BYTE = 8
#: segments plus characters of object-graph paths allowed on top of :data:`TF_PATH_UNITS_PER_BYTE`, for small graphs
TF_PATH_UNITS_SLACK = 1 << 16
#: bytes of keys an SSTable's shared prefixes may rebuild per byte of table: TF's entries rebuild a few bytes each
SSTABLE_KEY_BYTES_PER_BYTE = 16
#: bytes of rebuilt keys allowed on top of :data:`SSTABLE_KEY_BYTES_PER_BYTE`, for small tables
SSTABLE_KEY_BYTES_SLACK = 1 << 20

# -- delta versions and the shuffle-zstd codec ------------------------------------------------------
#: bytes of one delta block, which one zstd frame decodes to: what one frame may make a reader allocate
MAX_DELTA_BLOCK = 64 << 20
#: bases a delta reader follows to its anchor: a bound on the files one read opens (publishers anchor far sooner:
#: ``anchor_every`` is at most this plus one); a reader opens and rebuilds a chain in loops, so its stack is the
#: same however deep the chain
MAX_DELTA_CHAIN = 1000
#: bytes of a delta version's head, which lists its chain: 1,000 names of at most 255 bytes fit
MAX_DELTA_HEAD_BYTES = 1 << 20
#: bytes of a delta version's entries (and its manifest): three numbers or names per tensor, like the manifest's columns
MAX_DELTA_ENTRIES_BYTES = 64 << 20
#: bytes of a delta head or entries per JSON object or array, at least, so what they parse into stays a few times their
#: size
DELTA_BYTES_PER_CONTAINER = 16
#: bytes of one shuffle-zstd block, which one zstd frame decodes to: what one frame may make a reader allocate
MAX_SHUFFLE_BLOCK = 64 << 20

# -- versions and LATEST ----------------------------------------------------------------------------
#: bytes of ``LATEST``: it names a version and carries the user's metadata (writers refuse larger metadata)
MAX_POINTER_BYTES = 1 << 20
#: bytes of ``LATEST`` per JSON object or array, at least: JSON's own 2, since :data:`MAX_POINTER_BYTES` already bounds
#: a parse (about 32 MB for 1 MB of ``[[[``)
POINTER_BYTES_PER_CONTAINER = 2
#: digits of a step in a version's name: few enough that ``int`` reads them (it refuses over 4,300)
VERSION_NAME_DIGITS = 1000
#: bytes of a file name: what common file systems take; a version's name and its temporary must fit
FILE_NAME_BYTES = 255

# -- sharded versions -------------------------------------------------------------------------------
#: bytes of a sharded version's index (version 2): each rank checks its share before writing, so a commit never meets a
#: larger one; a 405B model on 1,000 ranks takes about 0.3 MB
MAX_INDEX_BYTES = 64 << 20
#: bytes of an index of version 1 (block tables inside) read
MAX_V1_INDEX_BYTES = 256 << 20
#: bytes of :data:`MAX_INDEX_BYTES` the key entries (key, dtype, shape, layout) may take: each rank checks its own keys,
#: the commit their union
KEY_BYTES = 16 << 20
#: bytes of :data:`MAX_INDEX_BYTES` kept for the header and metadata (``LATEST``'s, at most 1 MiB); the ranks share the
#: rest equally
RESERVED_BYTES = 4 << 20
#: bytes of a done-record: it grows with its rank's pieces, never with their blocks
MAX_DONE_BYTES = 64 << 20
#: bytes of a block table's header (its pieces' placement, JSON)
MAX_TABLE_HEADER_BYTES = 64 << 20
#: blocks in one member's table: 64 MiB of CRC-32s, 512 MiB of digests a follower may fetch
MAX_TABLE_BLOCKS = 1 << 24
#: bytes of index or done-record per JSON object or array, at least: a piece's entry takes 14 or more; 63 MB of empty
#: lists parsed into 2 GB
BYTES_PER_CONTAINER = 8
#: pieces of one key: the overlap check compares each piece with the ones beside it
MAX_PIECES_PER_KEY = 1 << 14
#: column strips one piece is cut into
MAX_STRIPS = 256
#: integers in an index (sizes, offsets, layouts) stay below this, so sums of them never overflow int64
MAX_INDEX_INTEGER = 1 << 62
#: pairs of pieces one index (or commit) may compare for overlap, at least: a 3-D grid of :data:`MAX_PIECES_PER_KEY`
#: pieces asks some 5 million, about 0.5 s
OVERLAP_PAIRS = 1 << 24
#: pairs of pieces compared per byte of index, where that is more than :data:`OVERLAP_PAIRS`: a bounded time per byte
#: parsed (an 11 MB "staircase" index once cost 42 s)
OVERLAP_PAIRS_PER_BYTE = 2
#: files one sharded reader's members hold open, a delta member's chain counted (also at most a quarter of the
#: soft limit on open files)
MAX_OPEN_MEMBER_FILES = 1024
#: attempts of one step a launch tries to claim before giving up: each claimed by another launch means launches racing
#: without end
MAX_CLAIMS = 64

# -- adapters ---------------------------------------------------------------------------------------
#: levels of containers in a parameter tree an adapter walks: containers nested deeper are no parameter tree
MAX_TREE_DEPTH = 64
