"""The tree kind's stored content on the config manager: :class:`TreeContent` (``content``), large inline trees split
out of their PUT (``inline``), their items read for a first PATCH (``inline_bases``) and overlay versions folded
in the background (``folds``)."""
