"""The web console: a second front door beside ``api/`` (docs/console.md).

A browser sees one account's machines, their fork trees and snapshots, over the same
services the API calls. ``boxd console`` mints a short-lived login token with an API key
(`boxd.console.login`); the page at ``/login?token=...`` trades it for a session cookie
(`boxd.console.sessions`). The app itself is `boxd.console.app.create_console_app`; this
package's root imports nothing, so the CLI can import `boxd.console.login` cheaply.
"""
