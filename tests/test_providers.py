"""Execution-provider discovery, resolution and session caching."""

import os
import threading
import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from gradbuilder.runtime import providers
from gradbuilder.runtime.providers import discovery
from gradbuilder.runtime.providers import sessions as session_cache
from gradbuilder.errors import InvalidArgumentError, ProviderError

from .helpers import make_model, vi

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def forget_everything():
    """An empty probe cache, warning memory, session cache and plugin list."""
    providers.forget()
    providers.clear_training_ep_instances()
    for name in discovery.plugin_libs():
        discovery.remove_plugin_lib(name)


@pytest.fixture
def fresh():
    """Start from an empty probe cache, warning memory, session cache and plugin list, and
    leave them empty (a later test probes and warns for itself)."""
    forget_everything()
    yield
    forget_everything()


def add_model_bytes(const=1.0):
    node = helper.make_node("Add", ["x", "c"], ["y"])
    c = helper.make_tensor("c", 1, [1], [const])
    return make_model([node], [vi("x", [2])], [vi("y", [2])], [c]).SerializeToString()


def session_gets(name):
    """Whether a plain onnxruntime session asked for ``name`` really runs on it."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = ort.InferenceSession(
            add_model_bytes(), sess_options=options, providers=[name, CPU], enable_fallback=0
        )
    return name in session.get_providers()


# ---------------------------------------------------------------- discovery


def test_available_providers_end_with_cpu_and_only_list_working_ones(fresh):
    available = providers.get_available_providers()
    assert available[-1] == CPU
    assert available.count(CPU) == 1
    listed = ort.get_available_providers()
    assert [p for p in listed if p in available] == available  # onnxruntime's order
    # CUDA is listed exactly when a session asked for it really gets it (never on a
    # machine without its libraries, although onnxruntime-gpu always lists it).
    assert (CUDA in available) == session_gets(CUDA)


def test_probe_runs_once_per_provider(fresh, monkeypatch):
    created = []
    real = ort.InferenceSession

    def counting(*args, **kwargs):
        created.append(kwargs.get("providers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", counting)
    first = providers.get_available_providers()
    expected = [p for p in ort.get_available_providers() if p not in (CPU, "AzureExecutionProvider")]
    assert [p[0] for p in created] == expected
    created.clear()
    assert providers.get_available_providers() == first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CUDA may be unusable here; that is tested below
        providers.resolve_providers()
        providers.resolve_providers([CUDA, CPU])
    assert created == []


def test_probe_is_quiet(fresh, capfd):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        providers.get_available_providers()
    out, err = capfd.readouterr()
    assert out == ""
    assert err == ""
    assert caught == []


def test_probe_restores_file_descriptors(fresh, capfd):
    providers.get_available_providers()
    os.write(2, b"still here\n")
    print("and here")
    out, err = capfd.readouterr()
    assert err == "still here\n"
    assert out == "and here\n"


def test_probe_is_thread_safe(fresh):
    results = []
    threads = [threading.Thread(target=lambda: results.append(providers.get_available_providers()))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r == results[0] for r in results)


# ---------------------------------------------------------------- resolution


def test_resolve_default(fresh):
    names, options = providers.resolve_providers()
    if CUDA in providers.get_available_providers():
        assert names == [CUDA, CPU]
        assert options == [{"use_tf32": "0"}, {}]  # float32 products in float32 unless asked
    else:
        assert names == [CPU]
        assert options == [{}]


def test_resolve_cpu_forms(fresh):
    assert providers.resolve_providers([CPU]) == ([CPU], [{}])
    assert providers.resolve_providers([]) == ([CPU], [{}])
    assert providers.resolve_providers([(CPU, {"arena": 1})]) == ([CPU], [{"arena": "1"}])
    assert providers.resolve_providers([CPU], [{"a": True}]) == ([CPU], [{"a": "True"}])


def test_resolve_unknown_name(fresh):
    with pytest.raises(ProviderError) as info:
        providers.resolve_providers(["NoSuchExecutionProvider"])
    message = str(info.value)
    assert "NoSuchExecutionProvider" in message
    for name in providers.get_available_providers():
        assert name in message


@pytest.mark.parametrize("args", [
    ("CPUExecutionProvider",),
    ([CPU], [{}, {}]),
    ([(CPU, {})], [{}]),
    ([CPU, CPU],),
    ([(CPU, "not a dict")],),
    ([42],),
    (None, [{}]),
])
def test_resolve_bad_arguments(fresh, args):
    with pytest.raises(InvalidArgumentError):
        providers.resolve_providers(*args)


def test_resolve_cuda_warns_once_and_falls_back(fresh):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = providers.resolve_providers([(CUDA, {"device_id": 0}), CPU])
        second = providers.resolve_providers([CUDA])
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    if CUDA in providers.get_available_providers():
        assert first == ([CUDA, CPU], [{"use_tf32": "0", "device_id": "0"}, {}])
        assert second == ([CUDA, CPU], [{"use_tf32": "0"}, {}])
        assert runtime == []
    else:
        assert first == second == ([CPU], [{}])
        assert len(runtime) == 1
        message = str(runtime[0].message)
        import onnxruntime

        # onnxruntime-gpu lists CUDA and cannot load it here; the CPU build does not have it
        reason = ("its libraries could not be loaded" if CUDA in onnxruntime.get_available_providers()
                  else f"this onnxruntime {onnxruntime.__version__} build does not include it")
        assert message == f"CUDAExecutionProvider is not usable on this machine ({reason}); training runs on CPUExecutionProvider"


def test_resolve_provider_missing_from_build_is_dropped(fresh):
    absent = next(p for p in ort.get_all_providers()
                  if p not in ort.get_available_providers())
    with pytest.warns(RuntimeWarning, match=f"{absent} is not usable.*does not include it"):
        assert providers.resolve_providers([absent]) == ([CPU], [{}])


def test_device_of():
    assert providers.device_of([CUDA, CPU]) == ("cuda", 0)
    assert providers.device_of([CUDA, CPU], [{"device_id": "1"}, {}]) == ("cuda", 1)
    assert providers.device_of([(CUDA, {"device_id": 2})]) == ("cuda", 2)
    assert providers.device_of([CPU]) == ("cpu", 0)
    assert providers.device_of(["TensorrtExecutionProvider", CUDA, CPU]) == ("cpu", 0)
    assert providers.device_of([]) == ("cpu", 0)
    with pytest.raises(InvalidArgumentError):
        providers.device_of([(CUDA, {"device_id": "gpu"})])


# ---------------------------------------------------------------- session cache


def test_cached_session_reuses_and_runs(fresh):
    model = add_model_bytes(2.0)
    a = providers.cached_session(model, None, [CPU], [{}])
    b = providers.cached_session(model, ort.SessionOptions(), [CPU], [{}])
    assert a is b
    out = a.run(None, {"x": np.array([1.0, 3.0], np.float32)})[0]
    np.testing.assert_allclose(out, [3.0, 5.0])
    assert providers.cached_session(add_model_bytes(3.0), None, [CPU], [{}]) is not a


def test_cached_session_keys_on_options(fresh):
    model = add_model_bytes()
    base = providers.cached_session(model, None, [CPU], [{}])

    threads = ort.SessionOptions()
    threads.intra_op_num_threads = 2
    two = providers.cached_session(model, threads, [CPU], [{}])
    assert two is not base
    threads_again = ort.SessionOptions()
    threads_again.intra_op_num_threads = 2
    assert providers.cached_session(model, threads_again, [CPU], [{}]) is two

    level = ort.SessionOptions()
    level.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert providers.cached_session(model, level, [CPU], [{}]) is not base

    config = ort.SessionOptions()
    config.add_session_config_entry("session.disable_prepacking", "1")
    assert providers.cached_session(model, config, [CPU], [{}]) is not base

    other = providers.cached_session(model, None, [CPU], [{"arena_extend_strategy": "kSameAsRequested"}])
    assert other is not base


def test_cached_session_never_caches_profiling(fresh, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    model = add_model_bytes()
    a = providers.cached_session(model, options, [CPU], [{}])
    b = providers.cached_session(model, options, [CPU], [{}])
    assert a is not b
    assert session_cache.cached_count() == 0
    a.end_profiling()
    b.end_profiling()


def test_clear_training_ep_instances(fresh):
    model = add_model_bytes()
    a = providers.cached_session(model, None, [CPU], [{}])
    providers.clear_training_ep_instances()
    assert session_cache.cached_count() == 0
    assert providers.cached_session(model, None, [CPU], [{}]) is not a


def test_cached_session_is_thread_safe(fresh):
    model = add_model_bytes()
    sessions = []
    threads = [threading.Thread(target=lambda: sessions.append(
        providers.cached_session(model, None, [CPU], [{}]))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(sessions) == 8 and all(s is sessions[0] for s in sessions)


def test_cached_session_bad_arguments(fresh):
    with pytest.raises(InvalidArgumentError):
        providers.cached_session("not bytes", None, [CPU], [{}])
    with pytest.raises(InvalidArgumentError):
        providers.cached_session(add_model_bytes(), None, [(CPU, {})], None)
    with pytest.raises(InvalidArgumentError):
        providers.cached_session(add_model_bytes(), None, [CPU], [{}, {}])


# ---------------------------------------------------------------- plugin libraries


def test_register_missing_library(fresh, tmp_path):
    missing = tmp_path / "libnothere.so"
    with pytest.raises(ProviderError, match="libnothere.so"):
        providers.register_provider_lib("NotHere", str(missing))
    assert discovery.plugin_libs() == {}


def test_register_non_library_file(fresh, tmp_path):
    text = tmp_path / "notalib.so"
    text.write_text("this is not a shared library\n")
    with pytest.raises(ProviderError) as info:
        providers.register_provider_lib("NotALib", str(text))
    assert str(text) in str(info.value)
    assert "Failed to load library" in str(info.value)  # onnxruntime's own message
    assert discovery.plugin_libs() == {}
    with pytest.raises(ProviderError, match="NotALib"):
        providers.resolve_providers(["NotALib"])


def test_unregister_unknown_library(fresh):
    with pytest.raises(ProviderError, match="NotRegistered"):
        providers.unregister_provider_lib("NotRegistered")


def test_registered_plugin_bookkeeping(fresh, monkeypatch, tmp_path):
    """What gradbuilder keeps for a registered plugin: its name becomes known and its
    default options sit under the caller's. onnxruntime's own registration calls are
    replaced here, as no plugin library is at hand."""
    calls = []
    monkeypatch.setattr(ort, "register_execution_provider_library",
                        lambda name, path: calls.append(("register", name, path)))
    monkeypatch.setattr(ort, "unregister_execution_provider_library",
                        lambda name: calls.append(("unregister", name)))
    lib = tmp_path / "libplugin.so"
    lib.write_bytes(b"")
    providers.register_provider_lib("PluginEP", str(lib), {"a": 1, "b": 1})
    assert calls == [("register", "PluginEP", str(lib))]

    real_probe = discovery.probe  # as if the probe had found it working
    monkeypatch.setattr(discovery, "probe", lambda name: name == "PluginEP" or real_probe(name))
    names, options = providers.resolve_providers([("PluginEP", {"b": 2})])
    assert names == ["PluginEP", CPU]
    assert options == [{"a": "1", "b": "2"}, {}]
    assert "PluginEP" in providers.get_available_providers()

    with pytest.raises(ProviderError, match="already registered"):
        providers.register_provider_lib("PluginEP", str(lib))

    providers.unregister_provider_lib("PluginEP")
    assert calls[-1] == ("unregister", "PluginEP")
    with pytest.raises(ProviderError, match="PluginEP"):
        providers.resolve_providers(["PluginEP"])


# ---------------------------------------------------------------- build facts


def test_version_and_build_strings():
    import gradbuilder

    version = providers.get_version_string()
    build = providers.get_build_info()
    assert version == gradbuilder.__version__  # bare, as onnxruntime.get_version_string() is
    assert build.startswith(f"gradbuilder {version} on onnxruntime {ort.get_version_string()}; ")
    assert isinstance(providers.has_collective_ops(), bool)


def test_cuda_computes_float32_in_float32_unless_tf32_is_allowed(fresh, monkeypatch):
    """onnxruntime's CUDA provider defaults to TF32 (use_tf32=1); gradbuilder asks for float32,
    as PyTorch does, unless allow_tf32 or the caller's own use_tf32 option says otherwise."""
    monkeypatch.setattr(providers, "works", lambda name: name in (CUDA, CPU))
    assert providers.resolve_providers([CUDA]) == ([CUDA, CPU], [{"use_tf32": "0"}, {}])
    assert providers.resolve_providers([CUDA], allow_tf32=True) == ([CUDA, CPU], [{"use_tf32": "1"}, {}])
    assert providers.resolve_providers([(CUDA, {"use_tf32": 1})]) == ([CUDA, CPU], [{"use_tf32": "1"}, {}])
    assert providers.resolve_providers([(CUDA, {"use_tf32": 0})], allow_tf32=True)[1][0] == {"use_tf32": "0"}
    assert providers.resolve_providers(None) == ([CUDA, CPU], [{"use_tf32": "0"}, {}])
    assert providers.resolve_providers([CPU]) == ([CPU], [{}])


def test_two_onnxruntime_builds_installed_side_by_side_are_named_with_the_fix(monkeypatch):
    """`pip install onnxruntime-gpu` beside the default `onnxruntime` leaves one module written
    by two packages: a warning names both and the command that keeps one."""
    import importlib.metadata

    installed = {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.warns(UserWarning, match=r"onnxruntime 1\.32\.0 and onnxruntime-gpu 1\.31\.1 are installed.*"
                                         r"pip uninstall -y onnxruntime onnxruntime-gpu && pip install"):
        discovery.check_one_build.__wrapped__()
    del installed["onnxruntime"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        discovery.check_one_build.__wrapped__()  # one build: nothing to say
