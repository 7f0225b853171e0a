"""Renders kernel templates into generated/<arch>/ and builds them into one C-ABI library."""
