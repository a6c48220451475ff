#!/bin/sh
# templates/embed.sh FILE.cuh... -- prints a C header embedding each CUDA C
# template as a string (ej_templates[]: name = the file's base name without
# .cuh, text = its contents), and templates/args.h, the argument structs
# every template is compiled with (ej_tmpl_args_text), for kernels/tmpl.c.  Run
# by make from the source folder.
echo '/* generated from the templates (*.cuh) by templates/embed.sh */'
echo "static const char ej_tmpl_args_text[] ="
sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/^/"/' -e 's/$/\\n"/' templates/args.h
echo ';'
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
