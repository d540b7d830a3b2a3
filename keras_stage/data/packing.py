"""`Packer`: many small tensors in, a few big ones out, bit for bit."""

import math

import tensorflow as tf

NUMERIC = "numeric"
STRINGS = "strings"
SHAPES = "shapes"

# Bytes per element of every dtype that packs bit for bit. bool has no
# bitcast kernel: it travels as uint8 (0 or 1) and is cast back.
_WIDTHS = {
    tf.bool: 1,
    tf.int8: 1,
    tf.uint8: 1,
    tf.int16: 2,
    tf.uint16: 2,
    tf.float16: 2,
    tf.bfloat16: 2,
    tf.int32: 4,
    tf.uint32: 4,
    tf.float32: 4,
    tf.int64: 8,
    tf.uint64: 8,
    tf.float64: 8,
    tf.complex64: 8,
    tf.complex128: 16,
}


def _carrier_dtype(widths: list[int]) -> tf.DType:
    """The dtype of the numeric tensor, the widest every leaf fills: uint8,
    uint32 or int64 (GPUs cannot slice uint16 or uint64, and TensorFlow
    keeps int32 tensors in host memory)."""
    common = math.gcd(*widths)
    if common >= 8:
        return tf.int64
    if common == 4:
        return tf.uint32
    return tf.uint8


class _Leaf:
    """Where one component tensor of the element lives in a packed one."""

    def __init__(self, spec: tf.TensorSpec, carrier: tf.DType | None):
        self.spec = spec
        self.group = STRINGS if spec.dtype == tf.string else NUMERIC
        self.dims = None if spec.shape.rank is None else spec.shape.as_list()
        self.dynamic = (
            []
            if self.dims is None
            else [i for i, d in enumerate(self.dims) if d is None]
        )
        # Carrier elements per leaf element.
        self.ratio = 1
        if self.group == NUMERIC:
            self.ratio = _WIDTHS[spec.dtype] // carrier.size
        # Set by the Packer: positions of this leaf's sizes in `shapes`.
        self.slots = []
        self.rank_slot = None

    @property
    def static_size(self) -> int | None:
        """Carrier elements the leaf takes, if the spec fixes it."""
        if self.dims is None or self.dynamic:
            return None
        return math.prod(self.dims) * self.ratio


def _is_more_specific(spec_shape, shape):
    """Whether `spec_shape` knows a dimension `shape` does not."""
    if spec_shape.rank is None:
        return False
    if shape.rank is None:
        return True
    return any(
        s is not None and d is None
        for s, d in zip(spec_shape.as_list(), shape.as_list(), strict=True)
    )


def _product(factors):
    """Product of Python ints and int64 scalar tensors, ints folded first."""
    static = math.prod(f for f in factors if isinstance(f, int))
    tensors = [f for f in factors if not isinstance(f, int)]
    if not tensors:
        return static
    result = tensors[0]
    for factor in tensors[1:]:
        result = result * factor
    return result if static == 1 else result * static


class Packer:
    """Packs the leaves of a `tf.data` element into a few flat tensors.

    DeepRec's `ENABLE_STAGE_PACK_TRANS`: each tensor costs one host-to-device
    copy, so `pack` runs on the host (in a `tf.data` map) and `unpack` on the
    device; `tf.bitcast` gives every value back exactly.
    A packed element is a dict of at most three 1-D tensors (a key with
    nothing to hold is left out):

    - `"numeric"`: every non-string leaf, bitcast to one carrier dtype
      (`_carrier_dtype`) and concatenated.
    - `"strings"`: every string leaf, flattened and concatenated.
    - `"shapes"`: int64, the runtime dimensions the element spec leaves
      unknown (e.g. the batch size).

    `element_spec` (e.g. `dataset.element_spec`) may nest dense, ragged and
    sparse specs (packed as their components) of a `_WIDTHS` or string dtype.

    Example:

    >>> import tensorflow as tf
    >>> from keras_stage.data.packing import Packer
    >>> columns = {f"f{i}": tf.range(8.0) for i in range(3)}
    >>> columns.update({f"c{i}": tf.range(8, dtype=tf.int64) for i in range(3)})
    >>> ds = tf.data.Dataset.from_tensor_slices(columns).batch(4)
    >>> packer = Packer(ds.element_spec)
    >>> packer.num_tensors, packer.num_packed_tensors, packer.worth_packing
    (6, 2, True)
    >>> packed = ds.map(packer.pack)
    >>> packed.element_spec == packer.packed_spec
    True
    >>> batch = next(iter(packed.map(packer.unpack)))
    >>> batch["c2"].numpy().tolist()
    [0, 1, 2, 3]
    """

    def __init__(self, element_spec):
        outer = tf.nest.flatten(element_spec)
        for spec in outer:
            if not isinstance(spec, tf.TypeSpec):
                raise TypeError(
                    "Invalid value for argument `element_spec`. Expected a "
                    "nest of tf.TypeSpec such as `dataset.element_spec`. "
                    f"Received: element_spec={element_spec!r} (bad item: "
                    f"{spec!r})"
                )
        self._element_spec = element_spec
        # Components of each outer leaf (several for ragged or sparse).
        self._parts = [
            tf.nest.flatten(s, expand_composites=True) for s in outer
        ]
        components = [c for part in self._parts for c in part]
        for spec, part in zip(outer, self._parts, strict=True):
            for component in part:
                if not isinstance(component, tf.TensorSpec) or (
                    component.dtype != tf.string
                    and component.dtype not in _WIDTHS
                ):
                    supported = ", ".join(sorted(d.name for d in _WIDTHS))
                    raise TypeError(
                        "Invalid value for argument `element_spec`. Packer "
                        f"packs tensors of dtype {supported} or string. "
                        f"Received: {spec!r} with component {component!r}"
                    )
        widths = [_WIDTHS[c.dtype] for c in components if c.dtype != tf.string]
        self._carrier = _carrier_dtype(widths) if widths else None
        self._leaves = [_Leaf(c, self._carrier) for c in components]

        # Layout of `shapes`: the unknown dimensions of leaves of known
        # rank, the rank of each leaf of unknown rank, then its dimensions.
        slot = 0
        for leaf in self._leaves:
            leaf.slots = list(range(slot, slot + len(leaf.dynamic)))
            slot += len(leaf.dynamic)
        self._unranked = [leaf for leaf in self._leaves if leaf.dims is None]
        for leaf in self._unranked:
            leaf.rank_slot = slot
            slot += 1
        self._num_fixed_slots = slot

        packed_spec = {}
        for group, dtype in ((NUMERIC, self._carrier), (STRINGS, tf.string)):
            sizes = [leaf.static_size for leaf in self._group(group)]
            if sizes:
                length = None if None in sizes else sum(sizes)
                packed_spec[group] = tf.TensorSpec([length], dtype)
        if slot:
            length = None if self._unranked else slot
            packed_spec[SHAPES] = tf.TensorSpec([length], tf.int64)
        self._packed_spec = packed_spec

    def _group(self, group):
        return [leaf for leaf in self._leaves if leaf.group == group]

    @property
    def packed_spec(self):
        """The element spec of packed elements: a dict of `tf.TensorSpec`."""
        return dict(self._packed_spec)

    @property
    def num_tensors(self):
        """Tensors in an element, counting each component of a composite."""
        return len(self._leaves)

    @property
    def num_packed_tensors(self):
        """Tensors in a packed element."""
        return len(self._packed_spec)

    @property
    def worth_packing(self):
        """Whether packing leaves fewer tensors to copy."""
        return self.num_packed_tensors < self.num_tensors

    def __repr__(self):
        return (
            f"Packer(num_tensors={self.num_tensors}, "
            f"num_packed_tensors={self.num_packed_tensors})"
        )

    def _as_element(self, args):
        # tf.data passes a `tuple` element's items as arguments; a call, one.
        spec = self._element_spec
        candidates = [args[0]] if len(args) == 1 else []
        if type(spec) is tuple:
            candidates.insert(0, args)
        for candidate in candidates:
            try:
                tf.nest.assert_same_structure(
                    spec, candidate, check_types=False
                )
            except (TypeError, ValueError):
                continue
            return candidate
        received = args[0] if len(args) == 1 else args
        raise ValueError(
            "Invalid value for argument `element`. Expected an element "
            f"structured like the packer's element spec {spec!r}. "
            f"Received: element={received!r}"
        )

    def _components(self, element):
        components = []
        for part, value in zip(
            self._parts, tf.nest.flatten(element), strict=True
        ):
            if not part:
                continue
            values = tf.nest.flatten(value, expand_composites=True)
            if len(values) != len(part):
                raise ValueError(
                    "Invalid value for argument `element`. Expected a value "
                    f"matching {part!r}. Received: {value!r}"
                )
            components.extend(values)
        return components

    @staticmethod
    def _checked(leaf, value):
        spec = leaf.spec
        value = tf.convert_to_tensor(value, dtype_hint=spec.dtype)
        if value.dtype != spec.dtype:
            raise TypeError(
                "Invalid value for argument `element`. Expected a tensor of "
                f"dtype {spec.dtype.name} for {spec!r}. Received: a tensor "
                f"of dtype {value.dtype.name} ({value!r})"
            )
        if not spec.shape.is_compatible_with(value.shape):
            raise ValueError(
                "Invalid value for argument `element`. Expected a tensor of "
                f"shape {spec.shape} for {spec!r}. Received: a tensor of "
                f"shape {value.shape} ({value!r})"
            )
        if _is_more_specific(spec.shape, value.shape):
            # `unpack` takes the static dimensions from the spec.
            value = tf.ensure_shape(value, spec.shape)
        return value

    def pack(self, *element):
        """Packs `element` (a tuple may come as separate arguments, as from
        `map`) into a dict of a few flat tensors matching `packed_spec`."""
        element = self._as_element(element)
        with tf.name_scope("pack"):
            groups = {NUMERIC: [], STRINGS: []}
            dims, ranks, unranked_dims = [], [], []
            for leaf, value in zip(
                self._leaves, self._components(element), strict=True
            ):
                value = self._checked(leaf, value)
                if leaf.dims is None:
                    shape = tf.shape(value, out_type=tf.int64)
                    ranks.append(tf.size(shape, out_type=tf.int64))
                    unranked_dims.append(shape)
                elif leaf.dynamic:
                    shape = tf.shape(value, out_type=tf.int64)
                    if len(leaf.dynamic) < len(leaf.dims):
                        shape = tf.gather(shape, leaf.dynamic)
                    dims.append(shape)
                if leaf.group == NUMERIC:
                    if value.dtype == tf.bool:
                        value = tf.cast(value, tf.uint8)
                    if value.dtype != self._carrier:
                        value = tf.bitcast(value, self._carrier)
                groups[leaf.group].append(tf.reshape(value, [-1]))
            if ranks:
                dims.append(tf.stack(ranks))
            groups[SHAPES] = dims + unranked_dims
            packed = {}
            for key, tensors in groups.items():
                if tensors:
                    packed[key] = (
                        tensors[0]
                        if len(tensors) == 1
                        else tf.concat(tensors, 0)
                    )
        return packed

    def unpack(self, packed):
        """Rebuilds the element `pack` packed into the dict `packed`."""
        if not isinstance(packed, dict) or set(packed) != set(
            self._packed_spec
        ):
            raise ValueError(
                "Invalid value for argument `packed`. Expected a dict with "
                f"keys {sorted(self._packed_spec)}, as returned by `pack`. "
                f"Received: packed={packed!r}"
            )
        with tf.name_scope("unpack"):
            shapes = packed.get(SHAPES)
            # Leaves of unknown rank: their dimensions follow the fixed slots.
            unranked_offset = self._num_fixed_slots
            offsets = {NUMERIC: 0, STRINGS: 0}
            singles = {group: len(self._group(group)) == 1 for group in offsets}
            components = []
            for leaf in self._leaves:
                if leaf.dims is None:
                    rank = shapes[leaf.rank_slot]
                    shape = shapes[unranked_offset : unranked_offset + rank]
                    unranked_offset = unranked_offset + rank
                    size = tf.reduce_prod(shape)
                    if leaf.ratio > 1:
                        size = size * leaf.ratio
                        shape = tf.concat(
                            [shape, tf.constant([leaf.ratio], tf.int64)], 0
                        )
                else:
                    dims = list(leaf.dims)
                    for axis, slot in zip(
                        leaf.dynamic, leaf.slots, strict=True
                    ):
                        dims[axis] = shapes[slot]
                    if leaf.ratio > 1:
                        dims.append(leaf.ratio)
                    size = _product(dims)
                    shape = dims
                    if leaf.dynamic:
                        shape = tf.stack(
                            [
                                tf.constant(d, tf.int64)
                                if isinstance(d, int)
                                else d
                                for d in dims
                            ]
                        )
                source = packed[leaf.group]
                if singles[leaf.group]:
                    piece = source
                else:
                    begin = offsets[leaf.group]
                    piece = source[begin : begin + size]
                    offsets[leaf.group] = begin + size
                value = tf.reshape(piece, shape)
                if leaf.spec.dtype == tf.bool:
                    value = tf.cast(value, tf.bool)
                elif value.dtype != leaf.spec.dtype:
                    value = tf.bitcast(value, leaf.spec.dtype)
                value.set_shape(leaf.spec.shape)
                components.append(value)
        return tf.nest.pack_sequence_as(
            self._element_spec, components, expand_composites=True
        )
