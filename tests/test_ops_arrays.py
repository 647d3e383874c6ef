"""Where op calls put their bytes (issue 21): numpy arrays used in place on the CPU backend, copies
only for arrays ggml cannot use (misaligned, non-contiguous, written into by the op), arrays that
stay on a device (ops.DeviceArray), DLPack in and out. Values against numpy float64; the copy
count is the graph's own (Graph.bytes_copied), so a regression to copying fails here."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabind import ops
from llamabind.ops import eager
from llamabind.ops.graph import BF16

rng = np.random.default_rng(0)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def last_graph():
    """The native graph of the only cached eager call (call ops.clear_cache() before it)."""
    (exe, _, _), *rest = eager._cache.values()
    assert not rest
    return exe.graph._ggml_graph


def test_aligned_arrays_are_used_in_place_on_the_cpu():
    a, b = f32(64, 64), f32(64, 64)
    ops.clear_cache()
    out = ops.add(a, b)
    np.testing.assert_array_equal(out, a + b)  # float32 add: exact
    assert last_graph().bytes_copied == 0
    out2 = ops.add(b, a)  # the same graph bound to other arrays
    np.testing.assert_array_equal(out2, a + b)
    assert out2 is not out and not np.shares_memory(out, out2)


def test_arrays_ggml_cannot_use_are_copied_and_still_right():
    base = f32(65 * 64 + 1)
    a = base[1:].reshape(65, 64)[:64]  # 4 bytes past the 16-byte alignment
    t = f32(64, 64).T  # not C-contiguous
    ops.clear_cache()
    np.testing.assert_array_equal(ops.add(a, t), a + t)
    assert last_graph().bytes_copied == a.nbytes + t.nbytes  # both copied once; the output in place


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
    offset=st.integers(0, 7),
    op=st.sampled_from(["add", "mul", "sub"]),
)
def test_element_wise_at_any_offset_matches_numpy(shape, offset, op):
    n = int(np.prod(shape))
    buf = f32(n + offset)
    a = buf[offset:].reshape(shape)
    b = f32(*shape)
    want = getattr(np, {"add": "add", "mul": "multiply", "sub": "subtract"}[op])(a.astype(np.float64), b)
    np.testing.assert_allclose(getattr(ops, op)(a, b), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(1023, 513), (512, 1024), (3, 5, 7, 11)])
def test_element_wise_over_threads_is_exact(shape):
    """Large enough for every core (patch 0022's flat ranges split across threads), sizes that do
    not divide evenly; float32 add/mul/sub/div are exact against numpy's float32."""
    a, b = f32(*shape), f32(*shape) + 3.0
    for op, ref in ((ops.add, np.add), (ops.mul, np.multiply), (ops.sub, np.subtract), (ops.div, np.divide)):
        np.testing.assert_array_equal(op(a, b), ref(a, b))


def test_an_op_that_writes_into_its_input_leaves_the_callers_array_alone():
    dst = f32(6, 8)
    keep = dst.copy()
    src = f32(2, 8)
    idx = np.array([4, 1], np.int64)
    out = ops.set_rows(dst, idx, src)
    want = keep.copy()
    want[idx] = src
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(dst, keep)


def test_views_of_inputs_follow_each_runs_arrays():
    x = f32(4, 6)
    with ops.graph("cpu") as g:
        t = g.input(x)
        y = ops.add(ops.reshape(t, (6, 4)), ops.transpose(ops.reshape(t, (4, 6))))  # two views of one input
        z = ops.reshape(t, (24,))  # an output that is a view of an input
    for v in (x, f32(4, 6), f32(4, 6)):
        yy, zz = g.compute(y, z, feed={t: v})
        np.testing.assert_array_equal(yy, v.reshape(6, 4) + v.T)
        np.testing.assert_array_equal(zz, v.reshape(24))
        assert not np.shares_memory(zz, v)


def test_threads_calling_the_same_cached_op_get_their_own_results():
    arrays = [f32(32, 32) for _ in range(8)]
    ops.add(arrays[0], arrays[0])
    errors = []

    def work(i):
        for _ in range(200):
            a = arrays[i]
            if not np.array_equal(ops.mul(a, a), a * a):
                errors.append(i)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


# ---- DeviceArray and DLPack (on the CPU device here; CUDA in tests/test_ops_backends.py)


def test_device_arrays_chain_without_host_copies():
    x, w = f32(16, 32), f32(32, 8)
    dx, dw = ops.to_device(x, "cpu"), ops.to_device(w, "cpu")
    assert isinstance(dx, ops.DeviceArray) and dx.device == "CPU" and dx.shape == (16, 32)
    ops.clear_cache()
    h = ops.mul_mat(dx, dw)  # DeviceArray in -> DeviceArray out
    assert isinstance(h, ops.DeviceArray) and last_graph().bytes_copied == 0
    y = ops.silu(ops.scale(h + h, 0.5))
    assert isinstance(y, ops.DeviceArray)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(y.numpy(), ref / (1 + np.exp(-ref)), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(y), y.numpy())


def test_mixed_device_and_numpy_arguments():
    x = f32(4, 4)
    d = ops.to_device(x, "cpu")
    r = ops.add(d, x)  # a numpy argument is copied in; the result stays a DeviceArray
    assert isinstance(r, ops.DeviceArray)
    np.testing.assert_array_equal(r.numpy(), x + x)


def test_dlpack_out_shares_memory_with_numpy():
    d = ops.to_device(f32(3, 5), "cpu")
    v = np.from_dlpack(d)
    assert v.shape == (3, 5) and v.dtype == np.float32
    v[1, 2] = 42.0  # numpy's view is the device memory itself
    assert d.numpy()[1, 2] == 42.0


def test_dlpack_in_shares_memory_and_keeps_it_alive():
    src = f32(4, 8)
    d = ops.from_dlpack(src)
    assert d.shape == (4, 8) and d.dtype == np.float32 and d.device == "CPU"
    src[0, 0] = 7.0
    assert d.numpy()[0, 0] == 7.0  # no copy was made
    del src
    np.testing.assert_array_equal(ops.add(d, d).numpy()[0, 0], 14.0)


def test_dlpack_rejects_what_ggml_cannot_hold():
    with pytest.raises(TypeError, match="DLPack dtype"):
        ops.from_dlpack(np.zeros(3, np.float64))
    with pytest.raises(TypeError, match="C-contiguous"):
        ops.from_dlpack(np.zeros((4, 4), np.float32).T)
    with pytest.raises(TypeError, match="C-contiguous"):
        ops.from_dlpack([1.0, 2.0])


def test_device_array_dtypes_round_trip():
    for dt in (np.float16, np.int32, np.int8, np.int64):
        a = (rng.standard_normal(12) * 10).astype(dt).reshape(3, 4)
        d = ops.to_device(a, "cpu")
        np.testing.assert_array_equal(d.numpy(), a)
        np.testing.assert_array_equal(np.from_dlpack(d), a)
    if BF16 is not None:
        b = np.arange(6, dtype=np.float32).astype(BF16)
        np.testing.assert_array_equal(ops.to_device(b, "cpu").numpy(), b)


def test_a_lazy_graph_takes_and_gives_device_arrays():
    x = f32(8, 16)
    d = ops.to_device(x, "cpu")
    with ops.graph("cpu") as g:
        t = g.input(d)
        y = ops.silu(ops.scale(t, 2.0))
    r = g.compute(y)
    assert isinstance(r, ops.DeviceArray)
    ref = 2.0 * x.astype(np.float64)
    np.testing.assert_allclose(r.numpy(), ref / (1 + np.exp(-ref)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g.compute(y, feed={t: x}), r.numpy(), rtol=0, atol=0)  # numpy feed: numpy out


def test_a_device_array_that_lies_about_its_size_is_refused():
    d = ops.to_device(f32(4, 4), "cpu")
    fake = ops.DeviceArray(d._buf, (8, 4), np.float32)  # 128 bytes claimed, 64 held
    with pytest.raises(ValueError, match="expected 128 bytes, got 64"):
        ops.add(fake, fake)


JUNK = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.floats(-1e3, 1e3), max_size=5),
    st.builds(
        lambda shape, dt: np.zeros(shape, dt),
        st.lists(st.integers(0, 3), max_size=5).map(tuple),
        st.sampled_from([np.float64, np.bool_, np.complex64, np.uint16, np.float32, np.int32]),
    ),
)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # huge ints -> float32 inf
@settings(max_examples=150, deadline=None)
@given(x=JUNK, backend=st.sampled_from([None, "cpu", "CPU", "cuda:7", "", "nope"]))
def test_junk_to_the_array_entry_points_raises_cleanly(x, backend):
    """to_device / from_dlpack / ops on DeviceArrays: TypeError or ValueError, or a right answer."""
    try:
        d = ops.to_device(x, backend)
    except (TypeError, ValueError):
        pass
    else:
        np.testing.assert_array_equal(d.numpy(), np.asarray(x, d.dtype))
        try:
            np.testing.assert_array_equal(ops.neg(d).numpy(), -np.asarray(x, d.dtype))
        except (TypeError, ValueError):
            pass
    try:
        e = ops.from_dlpack(x)
    except (TypeError, ValueError):
        pass
    else:
        np.testing.assert_array_equal(e.numpy(), x)
