#!/usr/bin/env bash
# Put LMSP Tray in the current user's application menu (XDG), or take it out again.
#
#   packaging/linux/install-desktop.sh [LAUNCHER]     install; Exec= runs LAUNCHER
#   packaging/linux/install-desktop.sh --uninstall    remove what an install put there
#
# LAUNCHER defaults to `lmsp-tray` on PATH, else the built dist/lmsp-tray/lmsp-tray
# (packaging/build.sh). Installs, under ${XDG_DATA_HOME:-~/.local/share}:
#   applications/io.github.lmsp_tray.LmspTray.desktop
#   icons/hicolor/<size>/apps/lmsp-tray.png, icons/hicolor/scalable/apps/lmsp-tray.svg
#   metainfo/io.github.lmsp_tray.LmspTray.metainfo.xml
# then refreshes the desktop and icon caches when update-desktop-database and
# gtk-update-icon-cache are there. Nothing needs root.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
ICONS="$ROOT/app/resources/icons"  # the app's own icons (package data), one copy
APP_ID="io.github.lmsp_tray.LmspTray"
ICON_NAME="lmsp-tray"
DATA="${XDG_DATA_HOME:-$HOME/.local/share}"
case "$DATA" in /*) ;; *) DATA="$HOME/.local/share" ;; esac  # the spec ignores a relative one
APPS="$DATA/applications"
HICOLOR="$DATA/icons/hicolor"
METAINFO="$DATA/metainfo"

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "install-desktop.sh: $*" >&2; exit 1; }

# One argument for Exec=, as the Desktop Entry spec wants it: `%` doubled; an argument with a
# reserved character double-quoted with " ` $ \ backslash-escaped inside; then every backslash
# doubled, because Exec is also a string value (so a literal \ ends up as \\\\).
exec_arg() {
  local s=${1//%/%%}
  local reserved='[[:space:]"'\''\\<>~|&;$*?#()`]'
  if [[ $s =~ $reserved ]]; then
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//\`/\\\`}
    s=${s//\$/\\\$}
    s="\"$s\""
  fi
  printf '%s' "${s//\\/\\\\}"
}

# A plain string value (TryExec=): only the backslash escape applies.
string_value() { printf '%s' "${1//\\/\\\\}"; }

refresh_caches() {
  if command -v update-desktop-database >/dev/null 2>&1; then
    update-desktop-database -q "$APPS" 2>/dev/null || true
  fi
  if command -v gtk-update-icon-cache >/dev/null 2>&1 && [ -d "$HICOLOR" ]; then
    gtk-update-icon-cache -q -f -t "$HICOLOR" 2>/dev/null || true
  fi
}

uninstall() {
  rm -f "$APPS/$APP_ID.desktop" "$METAINFO/$APP_ID.metainfo.xml"
  rm -f "$HICOLOR"/*/apps/"$ICON_NAME".png "$HICOLOR"/*/apps/"$ICON_NAME".svg
  refresh_caches
  echo "removed LMSP Tray from the application menu ($DATA)"
}

default_launcher() {
  local found
  if found="$(command -v lmsp-tray 2>/dev/null)" && [ -n "$found" ]; then
    printf '%s' "$found"
  elif [ -x "$ROOT/dist/lmsp-tray/lmsp-tray" ]; then
    printf '%s' "$ROOT/dist/lmsp-tray/lmsp-tray"
  else
    die "no launcher: no lmsp-tray on PATH and no $ROOT/dist/lmsp-tray/lmsp-tray (run packaging/build.sh), or give its path"
  fi
}

do_install() {
  local launcher="$1"
  [ -f "$launcher" ] && [ -x "$launcher" ] || die "$launcher is not an executable file"
  # Absolute, so the menu entry does not depend on the session's PATH or working folder.
  launcher="$(cd "$(dirname "$launcher")" && pwd)/$(basename "$launcher")"
  case "$launcher" in
    *%*) echo "install-desktop.sh: warning: GLib-based menus (GNOME, Xfce) skip an entry whose" \
              "program path contains '%'; consider a path without it" >&2 ;;
  esac

  local src="$HERE/$APP_ID.desktop" tmp done=""
  mkdir -p "$APPS" "$METAINFO"
  tmp="$(mktemp "$APPS/.$APP_ID.XXXXXX")"
  while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in
      TryExec=*) ;;
      Exec=*)
        if [ -z "$done" ]; then  # hide the entry if the launcher goes away
          printf 'TryExec=%s\n' "$(string_value "$launcher")"
          done=1
        fi
        printf 'Exec=%s\n' "$(exec_arg "$launcher")" ;;
      *) printf '%s\n' "$line" ;;
    esac
  done < "$src" > "$tmp"
  chmod 644 "$tmp"
  mv -f "$tmp" "$APPS/$APP_ID.desktop"

  local icon size
  for icon in "$ICONS"/hicolor/*/apps/"$ICON_NAME".png "$ICONS"/hicolor/*/apps/"$ICON_NAME".svg; do
    [ -f "$icon" ] || continue
    size="$(basename "$(dirname "$(dirname "$icon")")")"
    mkdir -p "$HICOLOR/$size/apps"
    cp -f "$icon" "$HICOLOR/$size/apps/"
    chmod 644 "$HICOLOR/$size/apps/$(basename "$icon")"
  done
  cp -f "$HERE/$APP_ID.metainfo.xml" "$METAINFO/"
  chmod 644 "$METAINFO/$APP_ID.metainfo.xml"

  refresh_caches
  echo "installed LMSP Tray in the application menu: $APPS/$APP_ID.desktop"
  echo "  runs: $launcher"
}

case "${1:-}" in
  -h|--help) usage ;;
  --uninstall) [ $# -eq 1 ] || die "--uninstall takes no other argument"; uninstall ;;
  -*) die "unknown option $1 (see --help)" ;;
  *)
    [ $# -le 1 ] || die "one launcher path at most (see --help)"
    launcher="${1:-}"
    [ -n "$launcher" ] || launcher="$(default_launcher)"
    do_install "$launcher" ;;
esac
