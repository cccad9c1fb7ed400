"""Item metadata and a request's ``filter`` over it: the metadata by column (``metadata``), the filter language
(``language``), what a filter means per edge of the tables (``edges``) and the index a version resolves filters
against (``index``)."""
