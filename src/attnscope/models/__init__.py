"""Models: offline loading (``loading``), built-in aliases (``registry``), the adapter table's machinery
(``adapters``) and the architecture families that hold its rows and bridges (``architectures``). Import from the
submodules; this package stays import-light."""
