#!/bin/sh
# templates/embed.sh FILE.cuh... -- prints a C header embedding each CUDA C
# template as a string (ej_templates[]: name = the file's base name without
# .cuh, text = its contents), for jit/tmpl.c.  Run by make.
echo '/* generated from the templates (*.cuh) by templates/embed.sh */'
for f in "$@"; do
	n=$(basename "$f" .cuh)
	echo "static const char ej_tmpl_text_$n[] ="
	sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^/"/' -e 's/$/\\n"/' "$f"
	echo ';'
done
echo 'static const struct {'
echo '	const char *name, *text;'
echo '} ej_templates[] = {'
for f in "$@"; do
	n=$(basename "$f" .cuh)
	echo "	{ \"$n\", ej_tmpl_text_$n },"
done
echo '	{ 0, 0 }'
echo '};'
echo 'static const char *const ej_template_names[] = {'
for f in "$@"; do
	echo "	\"$(basename "$f" .cuh)\","
done
echo '	0'
echo '};'
