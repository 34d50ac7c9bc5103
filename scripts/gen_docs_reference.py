"""Generates the reference pages (gRPC API, command line, settings) at build time."""

import mkdocs_gen_files

for name, title in (("grpc", "gRPC API"), ("cli", "Command line"), ("settings", "Settings")):
    with mkdocs_gen_files.open(f"reference/{name}.md", "w") as page:
        page.write(f"# {title}\n\nBeing generated.\n")
