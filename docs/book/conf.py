"""Sphinx settings of the handbook's website (`make book`); docs/book/build.py stages the sources it reads."""
project = "llminfer"
author = "the llminfer authors"
copyright = "the llminfer authors, MIT license"
html_title = "llminfer: an executable handbook of LLM inference"

extensions = ["myst_nb", "sphinx-mathjax-offline"]  # MathJax from _static/, not a CDN: math renders offline
nb_execution_mode = "off"           # the pages show the committed outputs; nothing runs
nb_merge_streams = True             # one block per cell for its printed lines
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3            # [text](04_kv_cache.ipynb#a-heading) resolves, or the build fails
exclude_patterns = ["llminfer/**", "widgets/**"]
nitpicky = True

html_theme = "sphinx_book_theme"
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "navigation_with_keys": True,
}
html_show_sourcelink = False
html_last_updated_fmt = None
# the theme's header already holds the search field: the sidebar does not repeat it
html_sidebars = {"**": ["navbar-logo.html", "icon-links.html", "sbt-sidebar-nav.html"]}
