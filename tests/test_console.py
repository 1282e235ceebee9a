"""The command line's errors stay whole off a terminal."""

from spmdkit._cli import main


def test_an_error_off_a_terminal_keeps_a_long_path_on_one_line(tmp_path, capsys):
    deep = tmp_path / ("d" * 90) / ("e" * 90)
    deep.mkdir(parents=True)
    code = main(["plan", "--task", "mlp", "--devices", "8", "--target", "h100x8", "--json", str(deep)])
    err = capsys.readouterr().err
    assert code == 2  # a directory where a file belongs: bad input
    line = next(l for l in err.splitlines() if l.startswith("error:"))
    assert f"--json '{deep}' is a directory." in line, err


def test_spmdkit_warnings_print_as_one_line_without_the_source(tmp_path, capsys):
    # batch 12 does not split over conftest's 8 devices: fit warns, and the user reads the message, not a
    # source line of spmdkit's loop
    code = main(["train", "--task", "linreg", "--steps", "2", "--batch-size", "12", "--no-progress",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0, err
    line = next(l for l in err.splitlines() if "does not split" in l)
    assert line.startswith("warning: batch_size=12 does not split over the 8 devices"), err
    assert "_loop.py" not in err and "warnings.warn(" not in err, err


def test_warnings_of_other_packages_keep_their_source(capsys, monkeypatch):
    import os
    import warnings

    import spmdkit
    from spmdkit._console import short_warnings

    shown = []  # what the hook in place before (Python's, or here pytest's) was handed
    monkeypatch.setattr(warnings, "showwarning", lambda m, c, f, n, *a: shown.append((str(m), f, n)))
    inside = os.path.join(os.path.dirname(spmdkit.__file__), "_x.py")
    with short_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("from spmdkit", UserWarning, inside, 3)
        warnings.warn_explicit("from elsewhere", UserWarning, "/elsewhere/lib.py", 7)
    assert capsys.readouterr().err.splitlines() == ["warning: from spmdkit"]
    assert shown == [("from elsewhere", "/elsewhere/lib.py", 7)]
