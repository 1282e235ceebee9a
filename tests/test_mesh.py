"""spmdkit.make_mesh: ordered named axes, -1 fill, Auto axis types, errors."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

import spmdkit


@pytest.mark.parametrize(
    "axes, shape",
    [
        ({"data": -1}, {"data": 8}),
        ({"data": 2, "model": 4}, {"data": 2, "model": 4}),
        ({"data": -1, "model": 2}, {"data": 4, "model": 2}),
        ({"data": 4, "model": -1}, {"data": 4, "model": 2}),
        ({"replica": 2, "data": -1, "model": 2}, {"replica": 2, "data": 2, "model": 2}),
        ({"model": 8, "data": 1}, {"model": 8, "data": 1}),
    ],
)
def test_shapes_and_order(axes, shape):
    mesh = spmdkit.make_mesh(**axes)
    assert dict(mesh.shape) == shape
    assert tuple(mesh.axis_names) == tuple(axes)  # order as given
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert mesh.devices.size == 8


def test_axes_as_one_mapping():
    # make_mesh({"data": 4, "model": 2}) (as dict(mesh.shape) and plan give a mesh) was a raw
    # "make_mesh() takes 0 positional arguments" TypeError.
    mesh = spmdkit.make_mesh({"model": 2, "data": -1}, devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"model": 2, "data": 2} and tuple(mesh.axis_names) == ("model", "data")
    assert spmdkit.make_mesh({"devices": 8}).axis_names == ("devices",)  # a name the keywords cannot take
    with pytest.raises(spmdkit.MeshError, match="either as one mapping of name to size or as keywords, not both"):
        spmdkit.make_mesh({"data": 4}, model=2)
    with pytest.raises(spmdkit.MeshError, match="not a tuple"):
        spmdkit.make_mesh(("data", 8))
    with pytest.raises(spmdkit.MeshError, match="axis names are strings"):
        spmdkit.make_mesh({1: 8})


def test_devices_subset():
    mesh = spmdkit.make_mesh(data=-1, model=2, devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 2, "model": 2}


def test_classic_sharding_constraint_works_on_our_mesh():
    # Seed 003 style code fails on Explicit axes; ours are Auto, so this runs.
    mesh = spmdkit.make_mesh(data=2, model=4)
    spec = jax.sharding.NamedSharding(mesh, jax.P(None, "model"))
    out = jax.jit(lambda x: jax.lax.with_sharding_constraint(x @ x.T, spec))(
        jax.numpy.ones((8, 8))
    )
    assert out.sharding.spec == jax.P(None, "model")


def test_error_product_mismatch_names_numbers_and_suggests():
    with pytest.raises(spmdkit.MeshError) as e:
        spmdkit.make_mesh(data=4, model=4)
    msg = str(e.value)
    assert "make_mesh(data=4, model=4) needs 16 devices but 8 are available" in msg
    assert "make_mesh(data=-1, model=4)" in msg
    # One way to simulate more devices, the exact one (it said use_host_devices(k), then (16)).
    assert msg.count("use_host_devices") == 1 and "use_host_devices(16)" in msg and "--host-devices 16" in msg


def test_error_product_mismatch_under_the_count_suggests_simulating_once():
    with pytest.raises(spmdkit.MeshError) as e:
        spmdkit.make_mesh(data=2, model=2)
    msg = str(e.value)
    assert "make_mesh(data=-1, model=2)" in msg and msg.count("use_host_devices(k)") == 1


def test_error_product_mismatch_without_divisible_last_axis():
    with pytest.raises(spmdkit.MeshError) as e:
        spmdkit.make_mesh(data=2, model=3)
    assert "needs 6 devices" in str(e.value) and "[1, 2, 4, 8]" in str(e.value)


def test_error_fill_not_divisible():
    with pytest.raises(spmdkit.MeshError, match="use 3 devices, which does not divide the 8"):
        spmdkit.make_mesh(data=-1, model=3)


@pytest.mark.parametrize(
    "axes, match",
    [
        ({}, "got no axes"),
        ({"data": -1, "model": -1}, "only one axis may be -1"),
        ({"data": 0}, "axis 'data' has size 0"),
        ({"data": 2.0}, "axis 'data' has size 2.0"),
    ],
)
def test_error_bad_axes(axes, match):
    with pytest.raises(spmdkit.MeshError, match=match):
        spmdkit.make_mesh(**axes)


def test_a_device_twice_is_an_error():
    d = jax.devices()
    with pytest.raises(spmdkit.MeshError, match=r"devices\[0\] and devices\[1\] are the same device"):
        spmdkit.make_mesh(data=8, devices=[d[0]] * 8)
    with pytest.raises(spmdkit.MeshError, match=r"devices\[1\] is a int, not a jax.Device"):
        spmdkit.make_mesh(data=2, devices=[d[0], 3])
