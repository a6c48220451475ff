#!/bin/sh
# t/check_part.sh PART -- one part of the Check suite: t/check_epjit with
# the suite names PART lists (one per line; '#' starts a comment).  make
# check runs every t/check-*.part this way, side by side under make -j.
# Exit 77 (SKIP) when the Check suite was not built.  With
# EPJIT_CHECK_XML_DIR=DIR each part writes Check's XML report (every test
# with its duration) to DIR/<part>.xml: where make check spends its time.
part=$1
builddir=$(cd "${top_builddir:-.}" && pwd) || exit 1
CHECK="$builddir/t/check_epjit"
if [ ! -x "$CHECK" ]; then
	echo "SKIP: $CHECK not built"
	exit 77
fi
if [ ! -r "$part" ]; then
	echo "check_part: cannot read $part" >&2
	exit 99
fi
suites=$(sed -e 's/#.*//' "$part" | tr -s ' \t\n' ' ')
if [ -z "${suites# }" ]; then
	echo "check_part: $part names no suite" >&2
	exit 99
fi
echo "check_part: $part: $suites"
if [ -n "${EPJIT_CHECK_XML_DIR:-}" ]; then
	CK_XML_LOG_FILE_NAME="$EPJIT_CHECK_XML_DIR/$(basename "$part" .part).xml"
	export CK_XML_LOG_FILE_NAME
fi
# shellcheck disable=SC2086
exec "$CHECK" $suites
