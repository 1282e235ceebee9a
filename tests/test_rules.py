"""Logical axis rules: presets, files, inline, and every validator error's message."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spmdkit
from spmdkit._rules import AxisRules, LayoutError, ReplicationWarning, check_spec, parse_mesh


def test_presets_map_the_builtin_vocabulary():
    assert AxisRules.preset("dp").spec(("batch", "embed")) == jax.P("data", None)
    assert AxisRules.preset("fsdp").spec(("layer", "embed", "hidden")) == jax.P(None, "data", None)
    assert AxisRules.preset("tp").spec(("embed", "hidden")) == jax.P(None, "model")
    assert AxisRules.preset("fsdp+tp").spec(("hidden", "embed")) == jax.P("model", "data")


def test_rules_from_a_toml_file_and_inline(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('batch = "data"\nhidden = "model"\nembed = "none"\nlayer = ["data", "model"]\n')
    rules = AxisRules.load(str(path))
    assert rules.mapping == {"batch": "data", "hidden": "model", "embed": None, "layer": ("data", "model")}
    assert AxisRules.load("batch=data,hidden=model").mapping == {"batch": "data", "hidden": "model"}
    with pytest.raises(LayoutError, match="neither a preset") as err:
        AxisRules.load("megatron")
    assert "did you mean" not in str(err.value)
    # Said as "--rules 'fsdp_tp' ..." also to Sharded(mesh, "fsdp_tp") and plan(rules=...), with no word of the preset meant.
    with pytest.raises(LayoutError, match=r"^rules 'fsdp_tp' is neither .* \(did you mean the preset 'fsdp\+tp'\?\)"):
        spmdkit.Sharded({"data": 2, "model": 4}, "fsdp_tp")
    with pytest.raises(LayoutError, match="does not exist"):
        AxisRules.load(str(tmp_path / "missing.toml"))


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert list(parse_mesh("model=-1,data=2")) == ["model", "data"]
    with pytest.raises(LayoutError, match="is not name=size"):
        parse_mesh("data:2")


class Annotated(nn.Module):
    names: tuple = ("embed", "hidden")
    shape: tuple = (8, 16)

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.ones, self.names), self.shape)
        return x @ w


def train_state(init, opt):
    """``make_state`` of the state fit trains, from a params init and an optimizer."""

    def make_state(rng):
        params = init(rng)
        return spmdkit.TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))

    return make_state


def plan(module, rules, mesh):
    strategy = spmdkit.Sharded(mesh, rules)
    return strategy.plan(train_state(lambda k: module.init(k, jnp.ones((2, module.shape[0])))["params"], optax.sgd(0.1)))


def test_error_logical_name_without_rule():
    with pytest.raises(LayoutError) as e:
        plan(Annotated(names=("embed", "heads")), AxisRules.load("batch=data,embed=none"), spmdkit.make_mesh(data=8))
    msg = str(e.value)
    assert "state.params['w'] has logical axis 'heads'" in msg
    assert "(they map ['batch', 'embed'])" in msg and "--replicate-unknown" in msg


def test_mesh_axis_names_in_a_constraint_are_named_as_mesh_axes():
    """('data', 'model') in a logical constraint: said "a logical axis no rule maps", and
    suggested a rule ("data", "model") mapping a mesh axis to a mesh axis."""
    rules = AxisRules.from_mapping({"batch": "data", "embed": ("data", "model")})
    with pytest.raises(LayoutError, match=r"(?s)names mesh axes \['model', 'x'\] of the mesh \{'data': 2, 'model': 4, 'x': 1\}"
                       r".*'model' \(size 4\): 'embed'; 'x' \(size 1\): no logical name maps to it"
                       r".*nn.with_logical_constraint\(x, \('embed', None, <a logical name for 'x'>, 'batch'\)\), after "
                       r"adding a rule.*jax.lax.with_sharding_constraint\(x, P\('model', None, 'x', 'data'\)\)"):
        rules.check_constraint(("model", None, "x", "batch"), {"data": 2, "model": 4, "x": 1})
    rules.check_constraint(("batch", "embed"), {"data": 2, "model": 4})  # logical names: fine


def test_mesh_axis_names_on_a_parameter_are_named_as_mesh_axes():
    """A parameter annotated with mesh axes: said "has logical axis 'model', which rules do not map"
    (and, under replicate_unknown, was replicated without a word)."""
    mesh = spmdkit.make_mesh(data=2, model=4)
    for replicate in (False, True):
        rules = AxisRules.load("batch=data,embed=none,hidden=model", replicate_unknown=replicate)
        with pytest.raises(LayoutError, match=r"(?s)state.params\['w'\] names mesh axes \['model'\] of the mesh "
                           r"\{'data': 2, 'model': 4\}.*'model' \(size 4\): 'hidden'"
                           + (r".*replicate_unknown replicates logical names that no rule maps, not a mesh axis's"
                              if replicate else "")
                           + r".*nn.with_logical_partitioning\(init_fn, \('embed', 'hidden'\)\).*"
                           r"nn.with_partitioning\(init_fn, P\(None, 'model'\)\)"):
            plan(Annotated(names=("embed", "model")), rules, mesh)
    with pytest.raises(LayoutError, match="has logical axis 'heads', which rules 'batch=data,embed=none' do not map"):
        plan(Annotated(names=("embed", "heads")), AxisRules.load("batch=data,embed=none"), mesh)  # still this error


def test_mesh_axis_names_in_a_constraint_are_an_error_under_replicate_unknown_too():
    rules = AxisRules.from_mapping({"batch": "data"}, replicate_unknown=True)
    with pytest.raises(LayoutError, match=r"(?s)names mesh axes \['model'\].*replicate_unknown replicates"):
        rules.check_constraint(("batch", "model"), {"data": 2, "model": 4})
    rules.check_constraint(("batch", "heads"), {"data": 2, "model": 4})  # an unknown logical name: replicated


def test_replicate_unknown_opt_in():
    rules = AxisRules.load("batch=data,embed=none", replicate_unknown=True)
    layout = plan(Annotated(names=("embed", "heads")), rules, spmdkit.make_mesh(data=8))
    assert layout.leaves[1].spec == jax.P(None, None)


def test_error_mesh_axis_used_twice():
    with pytest.raises(LayoutError) as e:
        plan(Annotated(), AxisRules.load("batch=data,embed=model,hidden=model"), spmdkit.make_mesh(data=2, model=4))
    msg = str(e.value)
    assert "state.params['w']: mesh axis 'model' is used twice" in msg
    assert "logical 'embed' and 'hidden'" in msg


def test_error_dimension_not_divisible():
    with pytest.raises(LayoutError) as e:
        plan(Annotated(shape=(8, 6)), AxisRules.preset("tp"), spmdkit.make_mesh(model=8))
    msg = str(e.value)
    assert "state.params['w']: dimension 1 (logical 'hidden') has size 6" in msg
    assert "(size 8) cannot split evenly" in msg
    # The fix names the name to map (it said "its logical name"), and the flags of the command line.
    assert "map 'hidden' to none" in msg and "CLI: a --mesh whose model size divides 6" in msg
    rules = AxisRules.from_mapping({**dict(AxisRules.preset("tp").table), "hidden": None})
    plan(Annotated(shape=(8, 6)), rules, spmdkit.make_mesh(model=8))  # the fix, applied: it fits


def test_error_rule_names_a_missing_mesh_axis():
    with pytest.raises(LayoutError) as e:
        spmdkit.Sharded(spmdkit.make_mesh(data=8), "dp+tp")
    msg = str(e.value)
    assert "rule 'hidden' -> 'model'" in msg and "mesh has axes ['data']" in msg
    assert "add model=N to --mesh" in msg


def test_error_direct_spec_with_unknown_mesh_axis():
    with pytest.raises(LayoutError, match="sharded over mesh axis 'tensor'"):
        check_spec(jax.P("tensor"), (8,), spmdkit.make_mesh(data=8), "x")


def test_warning_lists_the_largest_replicated_parameters():
    class MostlyPlain(nn.Module):
        @nn.compact
        def __call__(self, x):
            big = self.param("big", nn.initializers.ones, (256, 256))  # no logical names
            small = self.param("small", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "hidden")), (8, 16))
            return x @ small + jnp.sum(big)

    module = MostlyPlain()
    with pytest.warns(ReplicationWarning) as record:
        spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp").plan(
            train_state(lambda k: module.init(k, jnp.ones((2, 8)))["params"], optax.sgd(0.1))
        )
    msg = str(record[0].message)
    assert "state.params['big'] (256, 256)" in msg and "replicated on every device" in msg
    # Parameters kept under another name than params: the listing was empty.
    with pytest.warns(ReplicationWarning) as record:
        spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp").init(
            lambda k: {"p": module.init(k, jnp.ones((2, 8)))["params"]}, 0)
    assert "parameters: state['p']['big'] (256, 256)" in str(record[0].message)
    # Plain arrays: the warning named only Flax's annotation; Sharded's own state_axes= is their way.
    plain = lambda k: {"w": jnp.zeros((64, 64))}  # noqa: E731
    with pytest.warns(ReplicationWarning, match=r"Sharded\(\.\.\., state_axes=\) for plain arrays"):
        spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp").init(plain, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)  # the fix, applied: sharded, no warning
        state = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp",
                                state_axes={"w": ("embed", "hidden")}).init(plain, 0)
    assert state["w"].sharding.spec == P(None, "model")


def test_duplicate_mesh_axes_and_bare_rule_names_are_errors():
    with pytest.raises(LayoutError, match="axis 'data' is given twice"):
        parse_mesh("data=8,data=2,model=4")
    with pytest.raises(LayoutError, match="'hidden' is not logical=axis") as e:
        AxisRules.load("batch=data,hidden")
    assert "hidden=none to replicate" in str(e.value)
    with pytest.raises(LayoutError, match="'batch' is given twice"):
        AxisRules.load("batch=data,batch=model")
    # Named as rules, as the other rules errors are: Sharded(mesh, "...") is given no --rules flag.
    with pytest.raises(LayoutError, match=r"^rules 'batch=data,hidden': 'hidden' is not logical=axis"):
        spmdkit.Sharded({"data": 8}, "batch=data,hidden")


def test_rules_built_from_python_objects_are_checked_where_they_are_built():
    # A dict as the table worked until Sharded failed to unpack it; these failed raw or silently.
    assert AxisRules({"batch": "data", "hidden": ["data", "model"]}).table == (("batch", "data"), ("hidden", ("data", "model")))
    cases = [
        (lambda: AxisRules((("hidden", 3),)), r"rule 'hidden': 3 is not a mesh axis"),
        (lambda: AxisRules((("hidden",),)), r"\('hidden',\) is not a rule \(logical name, mesh axes\)"),
        (lambda: AxisRules({"batch": ("data", "data")}), r"names a mesh axis twice"),
        (lambda: AxisRules({"batch": "data"}, replicate_unknown="no"), r"replicate_unknown='no'\) must be True or False"),
        (lambda: AxisRules.load(None), r"AxisRules.load\(None\): a preset name"),
        (lambda: AxisRules.from_mapping([("batch", "data")]), r"needs a dict of logical name"),
        # "" replicated the name silently, where the command line's "hidden=" is an error
        (lambda: AxisRules({"batch": "data", "hidden": ""}), r"(?s)rule 'hidden': '' names no mesh axis.*\"none\""),
        (lambda: AxisRules({"hidden": "data,model"}), r"(?s)'data,model' names no mesh axis.*\[\"data\", \"fsdp\"\]"),
        (lambda: AxisRules({"hidden": ["data", " "]}), r"rule 'hidden': ' ' names no mesh axis"),
        # {1: "data"} was a rule for the name "1", which matches nothing, without a word
        (lambda: AxisRules.from_mapping({1: "data"}), r"(?s)the key 1 \(int\) is not a logical name.*\{\"batch\": \"data\"\}"),
    ]
    for build, words in cases:
        with pytest.raises(LayoutError, match=words):
            build()


def test_state_axes_as_lists_of_names():
    mesh = spmdkit.make_mesh(data=2, model=4)
    as_lists = spmdkit.Sharded(mesh, "dp+tp", state_axes={"w": ["embed", "hidden"], "b": ["mlp"]})
    as_tuples = spmdkit.Sharded(mesh, "dp+tp", state_axes={"w": ("embed", "hidden"), "b": ("mlp",)})
    make = lambda rng: {"w": jnp.ones((8, 8)), "b": jnp.ones(8)}  # noqa: E731
    a, b = as_lists.init(make, 0), as_tuples.init(make, 0)
    assert a["w"].sharding.spec == b["w"].sharding.spec
    assert a["b"].sharding.spec == b["b"].sharding.spec
    # A lone string is one name, not its characters ("names ('m', 'l', 'p') (3 name(s))" for the vector).
    as_string = spmdkit.Sharded(mesh, "dp+tp", state_axes={"w": ("embed", "hidden"), "b": "mlp"}).init(make, 0)
    assert as_string["b"].sharding.spec == b["b"].sharding.spec
    # A list of only None cannot be told from a list of parts: the error says which and how.
    with pytest.raises(LayoutError, match=r"state_axes\['w'\] is a list of only None.*\(None, None\)"):
        spmdkit.Sharded(mesh, "dp+tp", state_axes={"w": [None, None], "b": ["mlp"]}).init(make, 0)


@pytest.mark.parametrize("axes, where", [({"w": ("embed", 1)}, r"state_axes\['w'\]\[1\] is 1 \(int\)"),
                                         ({"w": ["embed", 2.0]}, r"state_axes\['w'\]\[1\] is 2.0 \(float\)"),
                                         ({"w": 3}, r"state_axes\['w'\] is 3 \(int\)")])
def test_state_axes_holding_a_number_is_named_by_path(axes, where):
    # Raised "TypeError: object of type 'int' has no len()" from inside Sharded (and spmdkit.plan).
    make = lambda rng: {"w": jnp.ones((8, 8))}  # noqa: E731
    with pytest.raises(LayoutError, match="(?s)" + where + r", not a logical name.*\('embed', 'hidden'\)"):
        spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp", state_axes=axes).plan(make)
    with pytest.raises(LayoutError, match=where):
        spmdkit.plan(make, lambda s, b: (s, {}), {"x": jnp.ones((8, 2))}, rules="dp+tp", target="h100x8", state_axes=axes)
    # a PartitionSpec there is still read as its names (and refused as mesh axes where logical names belong)
    with pytest.raises(LayoutError, match=r"names mesh axes \['data'\]"):
        spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), "dp+tp", state_axes={"w": P("data", None)}).plan(make)


def test_state_axes_that_contradict_the_models_own_names_are_an_error():
    # The model's box won and state_axes' names for that array were dropped without a word
    # (the plain bias beside it took state_axes' names).
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(8, kernel_init=init)(x)

    make = lambda rng: Dense().init(rng, jnp.zeros((1, 4)))  # noqa: E731

    def axes(kernel):
        return {"params": {"Dense_0": {"kernel": kernel, "bias": ("mlp",)}}}

    mesh = {"data": 2, "model": 4}
    with pytest.raises(LayoutError, match=r"state_axes names \('mlp', 'embed'\) for state\['params'\]\['Dense_0'\]"
                                          r"\['kernel'\], which the model already names \('embed', 'mlp'\)"):
        spmdkit.Sharded(mesh, "fsdp+tp", state_axes=axes(("mlp", "embed"))).plan(make)
    for agreeing in (("embed", "mlp"), None):  # the model's own names, or none, are fine
        layout = spmdkit.Sharded(mesh, "fsdp+tp", state_axes=axes(agreeing)).plan(make)
        assert {leaf.path: str(leaf.spec) for leaf in layout.leaves}["state['params']['Dense_0']['kernel']"] == \
            "P('data', 'model')"


def test_strategies_take_the_mesh_as_a_dict():
    make = lambda rng: {"w": jnp.ones((8, 8))}  # noqa: E731
    sharded = spmdkit.Sharded({"data": 2, "model": 4}, "dp+tp", state_axes={"w": ("embed", "hidden")})
    assert dict(sharded.mesh.shape) == {"data": 2, "model": 4}
    assert sharded.init(make, 0)["w"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert dict(spmdkit.DataParallel(mesh={"data": -1}).mesh.shape) == {"data": jax.device_count()}
    with pytest.raises(spmdkit.MeshError, match=r"mesh=\['data'\] is not a jax.sharding.Mesh or a dict"):
        spmdkit.Sharded(["data"], "dp")


def test_a_name_given_two_rules_maps_by_the_first_for_parameters_and_activations():
    # AxisRules([("hidden", "model"), ("hidden", "data")]) laid parameters out by the last rule
    # (hidden over data) while Flax's logical_axis_rules constrained activations by the first
    # (hidden over model): two layouts of one name, silently.
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "hidden")),
                           (8, 16))
            return nn.with_logical_constraint(x @ w, ("batch", "hidden"))

    pairs = [("batch", "data"), ("embed", None), ("hidden", "model"), ("hidden", "data")]
    rules = AxisRules(pairs)
    assert rules.mapping["hidden"] == "model" and rules.spec(("embed", "hidden")) == jax.sharding.PartitionSpec(None, "model")
    for given in (rules, pairs):  # AxisRules or Flax's own pairs: the same layout
        strategy = spmdkit.Sharded(spmdkit.make_mesh(data=2, model=4), given)
        layout = strategy.plan(lambda rng: {"params": Layer().init(rng, jnp.ones((2, 8)))["params"]})
        assert str(layout.leaves[0].spec) == "P(None, 'model')"
        assert strategy.describe()["rules_table"]["hidden"] == "model"


def test_presets_are_read_only_and_copy_into_a_table_of_ones_own():
    # An edit of spmdkit.PRESETS["dp"] changed the preset for every later user in the process.
    with pytest.raises(TypeError):
        spmdkit.PRESETS["dp"]["hidden"] = "model"
    with pytest.raises(TypeError):
        spmdkit.PRESETS["mine"] = {"batch": "data"}
    mine = AxisRules.from_mapping({**spmdkit.PRESETS["dp"], "hidden": "model"}, name="mine")
    assert mine.mapping["hidden"] == "model" and AxisRules.preset("dp").mapping["hidden"] is None


@pytest.mark.parametrize("spec, words", [
    # Taken as written before: a mesh axis named "data=model" (candidates "[data=model=4]"), and
    # "hidden=" replicated hidden without a word.
    ("batch=data=model", r"(?s)'batch' to 'data=model', which is no mesh axis name.*Fix: write batch=model"),
    ("batch=data,hidden=", r"(?s)'hidden' to '', which is no mesh axis name.*hidden=none to replicate"),
    ("batch=dat a", r"'batch' to 'dat a', which is no mesh axis name"),
    ("=data", r"(?s)'=data' is not logical=axis.*Fix: write hidden=data"),
])
def test_inline_rules_with_a_stray_equals_or_an_empty_axis_are_named(spec, words):
    with pytest.raises(LayoutError, match=words):
        AxisRules.load(spec)
    assert AxisRules.load("batch=data,hidden=none,mlp=model-2").table == (
        ("batch", "data"), ("hidden", None), ("mlp", "model-2"))


@pytest.mark.parametrize("text, words", [
    ("", r"(?s)rules file '.*r.toml' has no rules.*Fix: write one line per logical name"),
    ("# nothing but a comment\n", r"has no rules"),
    ('[rules]\nbatch = "data"\n', r"(?s)rules file '.*r.toml': \[rules\] is a section.*remove the \[rules\] line"),
])
def test_an_empty_or_sectioned_rules_file_is_named(tmp_path, text, words):
    # Before: one candidate excluded for "4 devices cannot be split over axes []", or
    # "rule 'rules': {...} is not a mesh axis" without the file's name.
    path = tmp_path / "r.toml"
    path.write_text(text)
    with pytest.raises(LayoutError, match=words):
        AxisRules.load(str(path))
