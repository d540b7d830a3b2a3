"""Tests of `keras_stage.data.packing.Packer`: exact round trips, counts."""

import textwrap

import numpy as np
import pytest
import tensorflow as tf

from keras_stage.data.packing import Packer
from tests.helpers import run_forked

NUMERIC_DTYPES = [
    tf.int8,
    tf.int16,
    tf.int32,
    tf.int64,
    tf.uint8,
    tf.uint16,
    tf.uint32,
    tf.uint64,
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.complex64,
    tf.complex128,
]
ALL_DTYPES = [tf.bool, tf.string, *NUMERIC_DTYPES]


def _random(dtype, shape, rng):
    """A tensor of `shape` whose elements are random bit patterns."""
    if dtype == tf.bool:
        return tf.constant(rng.integers(0, 2, shape).astype(bool))
    if dtype == tf.string:
        size = int(np.prod(shape))
        # Empty strings and bytes that are not UTF-8 included.
        words = [rng.bytes(int(n)) for n in rng.integers(0, 6, size)]
        return tf.reshape(tf.constant(words, tf.string), shape)
    width = dtype.size
    raw = rng.integers(0, 256, [*shape, width], dtype=np.uint8)
    if width == 1:
        return tf.bitcast(tf.constant(raw[..., 0]), dtype)
    return tf.bitcast(tf.constant(raw), dtype)


def _bits(tensor):
    """Exact contents: the bytes of numbers (so NaN == NaN), else values."""
    if tensor.dtype in (tf.bool, tf.string):
        return tensor.numpy()
    if tensor.dtype in (tf.uint8, tf.int8):
        return tf.cast(tf.bitcast(tensor, tf.int8), tf.int16).numpy()
    return tf.bitcast(tensor, tf.uint8).numpy()


def _assert_same(actual, expected):
    tf.nest.assert_same_structure(actual, expected, expand_composites=True)
    flat_actual = tf.nest.flatten(actual, expand_composites=True)
    flat_expected = tf.nest.flatten(expected, expand_composites=True)
    for a, e in zip(flat_actual, flat_expected, strict=True):
        if e is None:
            assert a is None
            continue
        assert a.dtype == e.dtype
        assert a.shape == e.shape
        np.testing.assert_array_equal(_bits(a), _bits(e))


def _round_trip(element):
    packer = Packer(tf.nest.map_structure(tf.type_spec_from_value, element))
    packed = packer.pack(element)
    return packer, packed, packer.unpack(packed)


def _dataset_round_trip(dataset):
    packer = Packer(dataset.element_spec)
    packed = dataset.map(packer.pack)
    unpacked = packed.map(packer.unpack)
    assert packed.element_spec == packer.packed_spec
    assert unpacked.element_spec == dataset.element_spec
    for got, expected in zip(unpacked, dataset, strict=True):
        _assert_same(got, expected)
    return packer


def _criteo_columns(batch_size, rng):
    columns = {
        f"I{i}": tf.constant(rng.normal(size=batch_size), tf.float32)
        for i in range(1, 14)
    }
    columns.update(
        {
            f"C{i}": tf.constant(
                rng.integers(-(2**63), 2**63 - 1, batch_size), tf.int64
            )
            for i in range(1, 27)
        }
    )
    return columns


# -- round trips -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_round_trip_keeps_values_dtypes_and_shapes(dtype):
    rng = np.random.default_rng(0)
    element = {
        "scalar": _random(dtype, [], rng),
        "matrix": _random(dtype, [4, 3], rng),
        "empty": _random(dtype, [0, 3], rng),
    }

    _, packed, unpacked = _round_trip(element)

    _assert_same(unpacked, element)
    assert len(packed) == 1  # all static: no shapes to send


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: d.name)
def test_round_trip_with_dynamic_batch_in_a_dataset(dtype):
    rng = np.random.default_rng(1)
    rows = {
        "x": _random(dtype, [5, 3], rng),
        "y": _random(dtype, [5], rng),
        "empty": _random(dtype, [5, 0], rng),
    }
    # 5 rows in batches of 2: the last batch is smaller.
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(2)

    packer = _dataset_round_trip(dataset)

    assert packer.packed_spec["shapes"].shape == (3,)


def test_several_dynamic_dimensions():
    rng = np.random.default_rng(6)
    lengths = [3, 0, 5, 1, 2]
    features = {
        "words": [_random(tf.string, [n], rng) for n in lengths],
        "values": [_random(tf.float32, [n, 2], rng) for n in lengths],
        "ids": [_random(tf.int16, [n, n], rng) for n in lengths],
    }

    def rows():
        for i in range(len(lengths)):
            yield {k: v[i].numpy() for k, v in features.items()}

    signature = {
        "words": tf.TensorSpec([None], tf.string),
        "values": tf.TensorSpec([None, 2], tf.float32),
        "ids": tf.TensorSpec([None, None], tf.int16),
    }
    # Each batch is padded to its own longest row.
    dataset = tf.data.Dataset.from_generator(
        rows, output_signature=signature
    ).padded_batch(2)

    packer = _dataset_round_trip(dataset)

    # Batch size and lengths: 2 for words, 2 for values, 3 for ids.
    assert packer.packed_spec["shapes"].shape == (7,)


def test_every_dtype_packs_together():
    rng = np.random.default_rng(2)
    rows = {d.name: _random(d, [7, 2], rng) for d in ALL_DTYPES}
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(3)

    packer = _dataset_round_trip(dataset)

    assert packer.num_tensors == len(ALL_DTYPES)
    # Bytes for the numbers, strings, shapes.
    assert packer.packed_spec["numeric"].dtype == tf.uint8
    assert packer.num_packed_tensors == 3


def test_nested_structures_and_tuple_elements():
    rng = np.random.default_rng(3)
    rows = (
        {
            "a": (_random(tf.float32, [6, 2], rng), {"b": tf.range(6)}),
            "c": _random(tf.string, [6], rng),
        },
        _random(tf.float64, [6, 2, 2], rng),
    )
    # A tuple element reaches `pack` as separate arguments in tf.data.
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(4)

    _dataset_round_trip(dataset)

    # A direct call passes the tuple as one argument.
    element = next(iter(dataset))
    packer = Packer(dataset.element_spec)
    _assert_same(packer.unpack(packer.pack(element)), element)
    _assert_same(packer.unpack(packer.pack(*element)), element)


def test_one_tuple_element():
    dataset = tf.data.Dataset.from_tensor_slices((tf.range(5.0),)).batch(2)
    packer = _dataset_round_trip(dataset)
    element = next(iter(dataset))
    _assert_same(packer.unpack(packer.pack(element)), element)


def test_none_components_are_kept():
    dataset = tf.data.Dataset.from_tensors((tf.range(3), None))
    packer = _dataset_round_trip(dataset)
    assert packer.num_tensors == 1


@pytest.mark.parametrize("ragged_rank", [1, 2])
def test_ragged_round_trip(ragged_rank):
    if ragged_rank == 1:
        rows = tf.ragged.constant([[1.5], [], [2.5, 3.5, 4.5], [5.5]])
    else:
        rows = tf.ragged.constant([[[1], [2, 3]], [], [[4, 5, 6]], [[7], []]])
    rows = tf.cast(rows, tf.float64)
    labels = tf.constant([0, 1, 0, 1], tf.int64)
    dataset = tf.data.Dataset.from_tensor_slices((rows, labels))
    dataset = dataset.ragged_batch(3)
    assert dataset.element_spec[0].ragged_rank == ragged_rank

    packer = _dataset_round_trip(dataset)

    # Values, row splits per ragged dimension, labels.
    assert packer.num_tensors == ragged_rank + 2
    unpacked = packer.unpack(packer.pack(*next(iter(dataset))))
    assert isinstance(unpacked[0], tf.RaggedTensor)
    assert unpacked[0].ragged_rank == ragged_rank


def test_sparse_round_trip():
    dense = tf.constant([[0, 7, 0], [0, 0, 0], [3, 0, 4], [0, 1, 0]], tf.int32)
    rows = tf.sparse.from_dense(dense)
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(3)

    packer = _dataset_round_trip(dataset)

    # Indices, values, dense shape.
    assert packer.num_tensors == 3
    unpacked = packer.unpack(packer.pack(next(iter(dataset))))
    assert isinstance(unpacked, tf.SparseTensor)
    np.testing.assert_array_equal(
        tf.sparse.to_dense(unpacked).numpy(), dense.numpy()[:3]
    )


def test_leaves_of_unknown_rank():
    def load(n):
        # A py_function's output has unknown rank until set_shape.
        x = tf.py_function(lambda n: tf.zeros([n, 2]) + 1.5, [n], tf.float32)
        # Two uint32 per float64: the leaf's sizes scale by its width.
        y = tf.py_function(
            lambda n: tf.fill([n, 1, n], tf.constant(-2.5, tf.float64)),
            [n],
            tf.float64,
        )
        words = tf.py_function(lambda n: tf.fill([n], "w"), [n], tf.string)
        return {"x": x, "y": y, "words": words, "n": n}

    dataset = tf.data.Dataset.range(4).map(load)
    assert dataset.element_spec["x"].shape.rank is None

    packer = _dataset_round_trip(dataset)

    assert packer.packed_spec["numeric"].dtype == tf.uint32
    assert packer.packed_spec["shapes"].shape.as_list() == [None]


def test_unpack_in_a_tf_function_with_unknown_batch_size():
    rng = np.random.default_rng(4)
    spec = {
        "ids": tf.TensorSpec([None, 4], tf.int64),
        "dense": tf.TensorSpec([None], tf.float32),
        "mask": tf.TensorSpec([None, 2], tf.bool),
        "words": tf.TensorSpec([None], tf.string),
    }
    packer = Packer(spec)

    @tf.function(input_signature=[spec])
    def round_trip(element):
        packed = packer.pack(element)
        for key, tensor in packed.items():
            assert packer.packed_spec[key].is_compatible_with(tensor)
        return packer.unpack(packed)

    # Static shapes survive tracing: only the batch size is unknown.
    outputs = round_trip.get_concrete_function().structured_outputs
    assert {k: v.shape.as_list() for k, v in outputs.items()} == {
        k: s.shape.as_list() for k, s in spec.items()
    }
    for batch_size in (3, 1, 0):
        element = {
            k: _random(s.dtype, [batch_size, *s.shape[1:]], rng)
            for k, s in spec.items()
        }
        _assert_same(round_trip(element), element)


# -- how many tensors --------------------------------------------------------


def test_criteo_batch_packs_into_few_tensors():
    rng = np.random.default_rng(5)
    rows = _criteo_columns(10, rng)
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(4)
    packer = Packer(dataset.element_spec)

    packed = next(iter(dataset.map(packer.pack)))

    assert packer.num_tensors == 39
    assert len(tf.nest.flatten(packed, expand_composites=True)) <= 3
    assert len(packed) == packer.num_packed_tensors
    assert packer.worth_packing
    # float32 and int64 share one 32-bit tensor, bit for bit.
    assert packer.packed_spec["numeric"].dtype == tf.uint32
    _dataset_round_trip(dataset)


def test_few_tensors_are_not_worth_packing():
    single = Packer(tf.TensorSpec([None, 3], tf.float32))
    assert single.num_tensors == 1
    assert not single.worth_packing

    pair = Packer(
        (tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.int64))
    )
    # Data and shapes: no fewer than the two leaves.
    assert pair.num_packed_tensors == 2
    assert not pair.worth_packing
    assert repr(pair) == "Packer(num_tensors=2, num_packed_tensors=2)"


# -- exactness ---------------------------------------------------------------


def test_special_float_and_int_values_survive_exactly():
    bits32 = np.array(
        [
            0x7FC00001,
            0x7F800001,
            0xFFC12345,
            0x7F800000,
            0xFF800000,
            0x80000000,
            1,
        ],
        np.uint32,
    )
    bits64 = np.array(
        [0x7FF8000000000001, 0x7FF0000000000001, 0xFFF0000000000000, 1 << 63],
        np.uint64,
    )
    bits16 = np.array([0x7C01, 0xFE01, 0x7C00, 0x8000, 0x7FC1], np.uint16)
    rows = {
        "f32": tf.bitcast(tf.constant(bits32), tf.float32),
        "f64": tf.bitcast(tf.constant(bits64), tf.float64),
        "f16": tf.bitcast(tf.constant(bits16), tf.float16),
        "bf16": tf.bitcast(tf.constant(bits16), tf.bfloat16),
        "i64": tf.constant([-(2**63), 2**63 - 1, -1, 0], tf.int64),
        "u64": tf.constant([2**64 - 1, 2**63, 0], tf.uint64),
        "i32": tf.constant([-(2**31), 2**31 - 1], tf.int32),
    }
    dataset = tf.data.Dataset.from_tensors(rows).repeat(2)
    packer = Packer(dataset.element_spec)

    for element in dataset.map(packer.pack).map(packer.unpack):
        for key, tensor in element.items():
            np.testing.assert_array_equal(_bits(tensor), _bits(rows[key]))
        assert element["i64"].numpy().tolist() == [-(2**63), 2**63 - 1, -1, 0]
        assert element["u64"].numpy().tolist() == [2**64 - 1, 2**63, 0]


@pytest.mark.timeout(120)
def test_packed_element_crosses_to_another_device():
    # Device configuration must precede TF's start and must not leak into
    # this session: a second logical CPU stands in for an accelerator.
    script = textwrap.dedent(
        """
        import numpy as np
        import tensorflow as tf
        from keras_stage.data.packing import Packer

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        rows = {
            "x": tf.reshape(tf.range(30.0), [10, 3]),
            "ids": tf.range(10, dtype=tf.int64) * (2**40),
            "mask": tf.range(10) % 3 == 0,
        }
        dataset = tf.data.Dataset.from_tensor_slices(rows).batch(4)
        packer = Packer(dataset.element_spec)
        packed = dataset.map(packer.pack).apply(
            tf.data.experimental.prefetch_to_device("/device:CPU:1")
        )

        unpack = tf.function(packer.unpack)

        # The iterator lives where the copies go, as in a distributed fit.
        with tf.device("/device:CPU:1"):
            iterator = iter(packed)
        count = 0
        for got, expected in zip(iterator, dataset, strict=True):
            device = got["numeric"].device
            assert device.endswith("CPU:1"), device
            with tf.device("/device:CPU:1"):
                out = unpack(got)
            for key in rows:
                assert out[key].device.endswith("CPU:1"), out[key].device
                np.testing.assert_array_equal(out[key], expected[key])
            count += 1
        print("batches", count)
        """
    )
    # Forked from a process that imported TensorFlow and ran no op.
    result = run_forked(["-c"], code=script, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "batches 3" in result.stdout


# -- errors ------------------------------------------------------------------


def test_rejects_an_element_spec_that_is_not_a_spec():
    with pytest.raises(TypeError, match="Expected a nest of tf.TypeSpec"):
        Packer({"x": tf.zeros([2])})


def test_rejects_unsupported_dtypes():
    nested = tf.data.Dataset.range(3).window(2)
    with pytest.raises(TypeError, match="component .*variant"):
        Packer(nested.element_spec)
    with pytest.raises(TypeError, match="Packer packs tensors of dtype"):
        Packer(tf.TensorSpec([2], tf.qint8))


def test_pack_rejects_elements_that_do_not_match_the_spec():
    packer = Packer(
        {"a": tf.TensorSpec([None, 2], tf.float32), "b": tf.TensorSpec([])}
    )
    with pytest.raises(ValueError, match="structured like"):
        packer.pack({"a": tf.zeros([1, 2])})
    with pytest.raises(TypeError, match="dtype float32 .* dtype int32"):
        packer.pack({"a": tf.zeros([1, 2], tf.int32), "b": 1.0})
    with pytest.raises(ValueError, match=r"shape \(None, 2\) .*\(1, 3\)"):
        packer.pack({"a": tf.zeros([1, 3]), "b": 1.0})

    ragged = Packer(tf.RaggedTensorSpec([None, None], tf.int64))
    with pytest.raises(ValueError, match="Expected a value matching"):
        ragged.pack(tf.zeros([2, 2], tf.int64))


def test_pack_checks_at_run_time_what_it_cannot_check_when_tracing():
    packer = Packer(tf.TensorSpec([None, 2], tf.float32))
    pack = tf.function(
        packer.pack, input_signature=[tf.TensorSpec(None, tf.float32)]
    )
    np.testing.assert_array_equal(
        packer.unpack(pack(tf.ones([3, 2]))), tf.ones([3, 2])
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="[Ss]hape"):
        pack(tf.ones([2, 3]))


def test_unpack_rejects_what_pack_did_not_return():
    packer = Packer((tf.TensorSpec([None]), tf.TensorSpec([None], tf.string)))
    with pytest.raises(ValueError, match=r"keys \['numeric', 'shapes', "):
        packer.unpack({"numeric": tf.zeros([2], tf.uint32)})
