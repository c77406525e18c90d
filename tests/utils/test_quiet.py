"""Library chatter: hidden by default, shown with log.verbose (train.py end to end:
tests/test_quickstart.py and tests/train/test_train.py)."""
import transformers

from minisparse.utils.quiet import hidden_prints, quiet_libraries


def test_quiet_hides_transformers_bars_and_warnings(monkeypatch):
    logging = transformers.utils.logging
    before = logging.get_verbosity(), logging.is_progress_bar_enabled()
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    try:
        logging.set_verbosity_warning()
        logging.enable_progress_bar()
        quiet_libraries(verbose=True)
        assert logging.get_verbosity() == logging.WARNING and logging.is_progress_bar_enabled()
        quiet_libraries(verbose=False)
        assert logging.get_verbosity() == logging.ERROR
        assert not logging.is_progress_bar_enabled()
    finally:
        logging.set_verbosity(before[0])
        (logging.enable_progress_bar if before[1] else logging.disable_progress_bar)()


def test_quiet_hides_liger_backend_notes():
    """Liger logs a warning per optional backend it cannot import (on every GPU run)."""
    import logging as std_logging

    liger = std_logging.getLogger("liger_kernel")
    notes = std_logging.getLogger("liger_kernel.backends.registry")
    before = liger.level
    try:
        liger.setLevel(std_logging.NOTSET)
        quiet_libraries(verbose=True)
        assert notes.isEnabledFor(std_logging.WARNING)
        quiet_libraries(verbose=False)
        assert not notes.isEnabledFor(std_logging.WARNING)
        assert notes.isEnabledFor(std_logging.ERROR)
    finally:
        liger.setLevel(before)


def test_hidden_prints(capsys):
    with hidden_prints(verbose=False):
        print("DeepSpeed op built successfully")
    with hidden_prints(verbose=True):
        print("shown")
    assert capsys.readouterr().out == "shown\n"
