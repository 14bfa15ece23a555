"""What every module of the library and every entry point shares: one-line errors, sweep failures, atomic writes."""
